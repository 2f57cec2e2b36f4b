"""Validation of every set by name: the ``data.split`` set (``valid``) and the ``data.valid`` sets.

Each set is fixed by the data config (megahash/data/validation.py, megahash/data/valid_sets.py) and
gives a loss (token-weighted mean, nats/token), the perplexity ``exp(loss)`` for token losses (clm, mlm;
null past a float's range, never capped) and the bits per byte of its text for clm (``bpb = sum NLL /
(ln 2 * bytes)``, lm-eval's ``bits_per_byte``; bytes counted per predicted token,
megahash/data/text_bytes.py). Objectives whose
loss is not a next-token NLL (mlm: masked tokens only; sr; hash-code heads) report no bpb.

:func:`report` logs a dict of metrics per set name: the ``valid`` set as before (``[valid]`` line, jsonl
split ``valid``, TensorBoard/W&B ``valid/loss``), a named set ``NAME`` as ``valid/NAME`` (``[valid/NAME]``,
``valid/NAME/loss``, ``valid/NAME/bpb``).
"""

from __future__ import annotations

import torch

from megahash.data import documents
from megahash.data.text_bytes import bits_per_byte, perplexity
from megahash.data.valid_sets import SPLIT_NAME
from megahash.training.hooks import Hook


def log_name(name: str) -> str:
    """The log prefix of a set: ``valid`` for the data.split set, ``valid/NAME`` for a named one."""
    return SPLIT_NAME if name == SPLIT_NAME else f"{SPLIT_NAME}/{name}"


def sets_of(data) -> dict:
    """{name: dataset} of every validation set of the run (the split's first, then data.valid's)."""
    sets = {SPLIT_NAME: data.valid} if data.valid is not None else {}
    sets.update(getattr(data, "valid_sets", None) or {})
    return sets


def evaluate(engine, batches, objective, token_bytes=None) -> dict:
    """Sums over this rank's (chunk index, batch, counted) of a fixed set, all-reduced over data-parallel ranks:
    {"nll": nats, "tokens": loss tokens, "sequences", "bytes": text bytes of the loss tokens (with
    ``token_bytes``)}. Corruption (mlm, sr) is seeded by the chunk, never by rank or step. A batch not counted
    (a stand-in: megahash/data/validation.py) runs its forward pass, the ranks' collective under ZeRO-3, and
    adds nothing."""
    from megatron.core import parallel_state

    engine.eval()
    dev = engine.device
    sums = torch.zeros(4, dtype=torch.float64, device=dev)
    with torch.no_grad():
        for chunk, batch, counted in batches:
            objective.set_step(-1 - chunk, 0)
            batch = objective.prepare({k: v.to(dev) for k, v in batch.items()})
            per_token = engine(
                batch["tokens"],
                hash_codes=batch.get("hash_codes"),
                labels=batch["labels"],
                padding_mask=batch.get("padding_mask"),
                label_codes=batch.get("label_codes"),
                **documents.forward_kwargs(batch),
            )  # data.reset_* (megahash/data/documents.py)
            if not counted:
                continue
            mask = batch["loss_mask"].double()
            nbytes = (token_bytes.label_bytes(batch["tokens"], batch["labels"]) * mask).sum() if token_bytes else 0.0
            sums += torch.stack(
                [
                    (per_token.double() * mask).sum(),
                    mask.sum(),
                    torch.tensor(float(batch["tokens"].shape[0]), dtype=torch.float64, device=dev),
                    torch.as_tensor(nbytes, dtype=torch.float64, device=dev),
                ]
            )
    engine.train()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums, group=parallel_state.get_data_parallel_group())
    nll, tokens, seqs, nbytes = sums.tolist()
    return {"nll": nll, "tokens": int(tokens), "sequences": int(seqs), "bytes": int(nbytes)}


def set_metrics(sums: dict, token_loss: bool, defined_bpb: bool) -> dict:
    """Loss (nats/token), perplexity (token losses) and bits per byte (clm) of a set's sums."""
    loss = sums["nll"] / max(sums["tokens"], 1)
    out = {"loss": loss, "tokens": sums["tokens"], "sequences": sums["sequences"]}
    if token_loss:
        out["ppl"] = perplexity(loss)
    if defined_bpb and sums["bytes"] > 0:
        out["bpb"] = bits_per_byte(sums["nll"], sums["bytes"])
        out["bytes"] = sums["bytes"]
    return out


def validate(run) -> dict:
    """{set name: metrics} of every validation set of a training run (megahash/training/trainer.py's Run);
    the hooks' metrics of each set too (``valid_metrics``: e.g. the weight average's ``ema_loss``)."""
    from megahash.data.validation import validation_batches
    from megahash.objective_spec import objective_spec, scores_tokens

    cfg, step = run.cfg, run.step
    token_loss = scores_tokens(cfg)
    next_token = token_loss and objective_spec(cfg.train.objective).next_token  # bits per byte of a next-token loss
    token_bytes = getattr(run.data, "token_bytes", None) if next_token else None
    results = {}
    for name, dataset in sets_of(run.data).items():

        def measure(dataset=dataset) -> dict:
            batches = validation_batches(dataset, cfg.data, run.dp_rank, run.dp_size)
            sums = evaluate(run.engine, batches, run.objective, token_bytes)
            return set_metrics(sums, token_loss, token_bytes is not None)

        metrics = measure()
        metrics.update(run.hooks.valid_metrics(run, lambda: _headline(measure())))  # a second pass each
        metrics.update(consumed_samples=run.consumed(step), consumed_tokens=run.consumed(step) * cfg.data.seq_length)
        results[name] = metrics
    return results


def _headline(metrics: dict) -> dict:
    """The metrics of a second pass over a set worth a column of their own (loss, ppl, bpb)."""
    return {k: v for k, v in metrics.items() if k in ("loss", "ppl", "bpb")}


def report(log, progress, step: int, total: int, results: dict) -> None:
    """Log ``{set name: metrics}`` at ``step``: jsonl, TensorBoard, W&B (RunLogger) and one progress line a set."""
    from megahash.training.progress import format_line

    for name, metrics in results.items():
        log.log(step, metrics, log_name(name), echo=False)
        progress.write(format_line(log_name(name), step, total, metrics))


class ValidSets(Hook):
    """Validation every ``train.eval_interval`` steps and at the last one, after the step is logged."""

    def end_step(self, run) -> None:
        n = run.cfg.train.eval_interval
        if run.step % n == 0 or run.step == run.cfg.train.steps:
            report(run.log, run.progress, run.step, run.cfg.train.steps, validate(run))


def hook(run) -> ValidSets | None:
    """Validation when the run has a set (``data.split``'s or ``data.valid``'s) and ``train.eval_interval`` > 0."""
    return ValidSets() if run.cfg.train.eval_interval and sets_of(run.data) else None
