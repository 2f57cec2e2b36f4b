"""Packed documents on CPU (issue 34): ATen calls per forward + backward step as the number of documents per
row grows (1, 4, 16), and throughput with the three flags on against the same model unmasked (ratios).

    python3 benchmarks/bench_packed_documents.py [--kinds mha,gqa,...] [--seq 256] [--batch 4] [--reps 5] [--out FILE]

Tiny decoder (h 64, 4 heads, 2 layers, fp32), one process, one thread; a step is forward + backward of the mean
loss. Times are medians of ``--reps`` steps after one warm-up, the two runs interleaved step by step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

SOFTMAX = "mha,gqa,mqa,sha,skv,el-att,mhe-add,mhe-mul,mha-megatron"
EOD, VOCAB = 2, 512


def _row(batch: int, seq: int, docs: int, g) -> torch.Tensor:
    tok = torch.randint(5, VOCAB, (batch, seq), generator=g)
    if docs > 1:  # docs - 1 EODs at even spacing (the last document runs to the row's end)
        tok[:, [(i + 1) * seq // docs - 1 for i in range(docs - 1)]] = EOD
    return tok


def _step(model, tok, kw):
    model.zero_grad(set_to_none=True)
    loss = model(tok, labels=torch.roll(tok, -1, 1), **kw).mean()
    loss.backward()


def measure(kind: str, seq: int, batch: int, reps: int) -> list[dict]:
    from megahash.config import load_config
    from megahash.data import documents
    from megahash.models.megatron_model import build_model
    from megahash.training.op_count import CountOps

    cfg = load_config(
        None,
        [
            f"model.schedule=uniform:{kind}",
            "model.hidden_size=64",
            "model.num_heads=4",
            "model.num_layers=2",
            "model.ffn_hidden_size=128",
            f"data.seq_length={seq}",
            f"model.max_position_embeddings={seq}",
            "data.reset_attention_mask=true",
            "data.reset_position_ids=true",
            "data.eod_mask_loss=true",
        ],
    )
    torch.manual_seed(0)
    model = build_model(cfg, VOCAB)
    g = torch.Generator().manual_seed(0)
    rows = []
    for docs in (1, 4, 16):
        tok = _row(batch, seq, docs, g)
        doc = documents.document_ids(tok, EOD)
        kw_on = {"document_ids": doc, "position_ids": documents.position_ids(doc)}
        out = {"kind": kind, "docs": docs}
        runs = (("off", {}), ("on", kw_on))
        times = {name: [] for name, _ in runs}
        for name, kw in runs:
            _step(model, tok, kw)
            with CountOps() as c:
                _step(model, tok, kw)
            out[f"ops_{name}"] = c.total()
        for _ in range(reps):  # interleaved, so a load change on the shared machine hits both alike
            for name, kw in runs:
                t = time.perf_counter()
                _step(model, tok, kw)
                times[name].append(time.perf_counter() - t)
        for name in times:
            out[f"s_{name}"] = statistics.median(times[name])
        rows.append(out)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default=SOFTMAX)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from megahash.accelerator import process_groups

    process_groups.init_distributed(1)
    lines = [
        "| kind | docs/row | ATen calls unmasked | ATen calls resets | step ms unmasked | step ms resets | "
        "resets / unmasked |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    try:
        for kind in a.kinds.split(","):
            for r in measure(kind, a.seq, a.batch, a.reps):
                lines.append(
                    f"| {r['kind']} | {r['docs']} | {r['ops_off']} | {r['ops_on']} | {1e3 * r['s_off']:.1f} | "
                    f"{1e3 * r['s_on']:.1f} | {r['s_on'] / r['s_off']:.2f} |"
                )
                print(lines[-1], flush=True)
    finally:
        process_groups.teardown()
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
