"""Megahash language models in transformers: the ``PreTrainedModel`` wrapper around the plain-torch
shell (:mod:`megahash.models.reference_layers`), written as ``modeling_megahash.py`` by ``megahash
export-hf`` (:mod:`megahash.convert.remote_code` assembles the folder from the library's own
torch-only modules and each kind's class: an attention kind written once, the plain-torch layer derived from
it by the shell; the embedding's and head's ``@register_reference`` classes).

Self-contained in the export: torch + transformers (+ numpy through the hashing module for raw
text), no megatron-core or DeepSpeed. Parameter names are megahash's TP=1 names
(``model.embedding.*``, ``model.decoder.layers.N.self_attention.linear_q.weight``, ...,
``output_layer.weight``, ``head.linear.*``), so the export is a plain copy of the weights and the
import its inverse.

Architecture (``MegahashLM`` of megahash/models/megatron_model.py): embedding (the embedding kind's reference,
special-token table) -> layers (one attention kind per layer from the config's ``layer_specs``,
`skip` layers as identities) -> final norm -> head (vocab logits, tied or not; or the head kind's
reference). RoPE is megatron's non-interleaved rotary (rotate_half), base ``rope_theta``.

``generate()`` caches (:class:`MegahashCache`, one dict per layer, batch first): each attention
reference keeps what it needs (softmax kinds keys/values, linear kinds their recurrent state, the
fixed-Q/K kinds the values only: their Q, K come from the fixed input run once through the stack
and kept as cached maps, recomputed in training mode or after
:meth:`MegahashPreTrainedModel.reset_kind_inputs`). Inputs a kind adds (``config.kind_inputs``) are
built from the kind's ``input:KIND`` reference and asked for their part of each forward's context.

Hash embeddings read ``hash_codes`` [b, s, width] (the data stage's side-shard codes); the model's
``encode_text(text)`` computes ids and codes with the hashing module's ``TextCoder`` (files of the
exported folder), and ``generate()`` computes the codes of generated tokens the same way.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast, MaskedLMOutput

try:
    from transformers import GenerationMixin
except ImportError:  # pragma: no cover - very old transformers
    GenerationMixin = object
try:
    from transformers import StoppingCriteria as _StoppingBase
    from transformers import StoppingCriteriaList as _StoppingList
except ImportError:  # pragma: no cover - very old transformers
    _StoppingBase, _StoppingList = object, list
try:
    from transformers.cache_utils import Cache as _CacheBase
except ImportError:  # pragma: no cover
    _CacheBase = object

from megahash.models.arch import arch_of
from megahash.models.hf_config import MegahashConfig
from megahash.models.mixing import LayerCache, MixState, readout_multiplier
from megahash.models.reference_layers import (
    Decoder,
    RobertaEmbeddingExtras,
    build_embedding,
    build_head,
    build_kind_input,
    rebuild_buffers,
)
from megahash.models.reference_ops import is_roberta, megahash_option, packed_documents, rope_freqs
from megahash.models.reference_table import references
from megahash.models.value_embeds import build as build_value_embeds

# transformers renamed the cache argument and output field ``past_key_values`` -> ``cache`` (5.2x, the old
# name deprecated): the model takes either name and answers under the name this transformers reads.
CACHE_FIELD = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


# the Auto class each model class is loaded with (the export's auto_map)
AUTO_CLASS = {"MegahashForCausalLM": "AutoModelForCausalLM", "MegahashForMaskedLM": "AutoModelForMaskedLM"}


def _given_cache(past_key_values, kwargs):
    """The cache passed under either name (``cache`` or the older ``past_key_values``)."""
    given = kwargs.pop("cache", None)
    return given if given is not None else past_key_values


# =============================================================================== cache


class MegahashCache(_CacheBase):
    """Decoding state of every layer (dicts of batch-first tensors) and the number of tokens seen."""

    is_compileable = False

    def __init__(self, num_layers: int):
        try:
            super().__init__(layers=[])
        except TypeError:  # pragma: no cover - other Cache signatures
            pass
        self.states = [LayerCache() for _ in range(num_layers)]
        self.offset = 0
        self.inputs: dict = {}  # batch-first tensors the kind inputs carry between steps (e.g. previous token ids)

    def __len__(self):
        return len(self.states)

    def layer(self, i: int) -> dict:
        """The cache dict of layer i (0-based; what ``MixState.cache`` asks)."""
        return self.states[i]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.offset

    def get_max_length(self, layer_idx=None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.offset

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.offset > 0

    @property
    def batch_size(self) -> int:
        for st in self.states:
            for k, v in st.items():
                if st.batch_dims.get(k, 0) is not None:
                    return v.shape[st.batch_dims.get(k, 0)]
        return -1

    def reset(self):
        self.states = [LayerCache() for _ in self.states]
        self.inputs = {}
        self.offset = 0

    def _map(self, fn):
        """``fn(tensor, its batch dim)`` on every batched tensor (the layers' by their ``batch_dims``)."""
        for st in self.states + [self.inputs]:
            dims = getattr(st, "batch_dims", {})
            for k in list(st):
                if dims.get(k, 0) is not None:
                    st[k] = fn(st[k], dims.get(k, 0))

    def reorder_cache(self, beam_idx):
        self._map(lambda t, d: t.index_select(d, beam_idx.to(t.device)))

    def batch_select_indices(self, indices):
        self._map(lambda t, d: t[(slice(None),) * d + (indices,)])

    def batch_repeat_interleave(self, repeats: int):
        self._map(lambda t, d: t.repeat_interleave(repeats, dim=d))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("MegahashCache cannot be cropped (recurrent states of linear attention kinds)")


# =============================================================================== models


class MegahashPreTrainedModel(PreTrainedModel):
    config_class = MegahashConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True  # MegahashModel recomputes each layer (gradient_checkpointing_enable)
    _no_split_modules = ["Layer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        rebuild_buffers(module)  # a kind's non-persistent buffers, which loading leaves empty (reference_layers)
        std = float((self.config.megahash_config.get("model") or {}).get("init_std", 0.02))
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(0.0, std)

    # -- text helpers -------------------------------------------------------------------------
    def set_text_coder(self, coder) -> None:
        """Use ``coder`` (a ``hashing_megahash.TextCoder``) for ``encode_text`` and generation."""
        self._text_coder = coder
        if isinstance(getattr(self, "model", None), MegahashPreTrainedModel):
            self.model._text_coder = coder

    def codes_for_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Word-hash codes [b, s, width] of token id rows (each row one text from its start), computed
        by the text coder; word streams: from the word table (an <unk> token gets zero codes, while
        ``encode_text`` hashes unknown words themselves)."""
        coder = self.text_coder
        rows = [torch.from_numpy(coder.codes(row)) for row in input_ids.tolist()]
        codes = torch.stack(rows).to(input_ids.device)
        return codes if codes.dtype == torch.uint8 else codes.long()

    @property
    def text_coder(self):
        coder = getattr(self, "_text_coder", None)
        if coder is None:
            from megahash.hashing.text_coder import HASHING_FILE, TextCoder

            folder = getattr(self.config, "_name_or_path", "") or ""
            if folder and not os.path.isdir(folder):  # a Hub repository id: fetch the hashing files
                try:
                    from huggingface_hub import snapshot_download

                    folder = snapshot_download(folder, allow_patterns=["megahash_*", "tokenizer.model"])
                except Exception:  # offline / no such repository: reported below
                    pass
            if not os.path.isfile(os.path.join(folder, HASHING_FILE)):
                raise ValueError(
                    f"no {HASHING_FILE} in {folder!r}: load the model from its exported folder or call "
                    "model.set_text_coder(TextCoder.from_pretrained(folder))"
                )
            coder = self._text_coder = TextCoder.from_pretrained(folder)
        return coder

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' ``save_pretrained``, plus the text side of the folder the model was loaded from
        (``megahash_hashing.json`` and the pieces/word table/LSH/tokenizer files it names), without which the
        saved copy could not hash ids (a hash embedding's forward) nor ``encode_text``; and, on transformers 4.x,
        the modeling code (which 5.x copies by itself)."""
        if getattr(self, "_auto_class", None) is None and type(self).__module__.startswith("transformers_modules"):
            # loaded as remote code by a transformers that does not mark it (4.x): without the mark its
            # save_pretrained writes the config's code but not modeling_megahash.py, and the copy cannot load
            self._auto_class = AUTO_CLASS.get(type(self).__name__, "AutoModel")
        out = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            try:
                coder = self.text_coder
            except ValueError:  # built in memory, or loaded from a folder without them: nothing to carry
                coder = None
            if coder is not None and coder.files[0] is not None:
                coder.save_pretrained(str(save_directory))
        return out

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
        """transformers' resize of the vocabulary table (and of the untied output layer), plus the tables indexed
        by token that transformers does not know of (``model.value_embeds``); ``config.padded_vocab_size`` (the
        rows the model is built with on reload) follows the new table. Refused (ValueError) for models that read
        word-hash codes: a new id has no piece for the hash to read."""
        base = self.model if isinstance(getattr(self, "model", None), MegahashPreTrainedModel) else self
        if base.get_input_embeddings() is None or self.needs_codes():
            raise ValueError(
                f"resize_token_embeddings: the {self.config.embedding!r} embedding"
                + (f" with the {self.config.head!r} head" if getattr(self, "head", None) is not None else "")
                + " reads word-hash codes of the tokenizer's pieces (no vocabulary table a new token could get a "
                "row of); only vocabulary-embedding models are resized"
            )
        out = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        rows = out.weight.shape[0]
        if base.value_embeds is not None:
            tables = base.value_embeds.tables
            for i, table in enumerate(tables):
                if table.weight.shape[0] != rows:
                    tables[i] = self._get_resized_embeddings(table, rows, mean_resizing=mean_resizing)
        self.config.padded_vocab_size = rows
        tree = (self.config.megahash_config or {}).get("model")
        if isinstance(tree, dict) and tree.get("vocab_size"):  # the folder's two configs keep naming one model
            tree["vocab_size"] = int(self.config.vocab_size)
        return out

    def needs_codes(self) -> bool:
        base = self.model if isinstance(getattr(self, "model", None), MegahashPreTrainedModel) else self
        head = getattr(self, "head", None)
        return bool(self.config.hash_spec) and (
            base.embedding_needs_codes() or bool(getattr(head, "reads_codes", False))
        )

    def embedding_needs_codes(self) -> bool:
        base = self.model if isinstance(getattr(self, "model", None), MegahashPreTrainedModel) else self
        return bool(getattr(base.embedding, "needs_codes", False))

    def encode_text(self, text: str, return_tensors: bool = True):
        """Raw text -> (input_ids [1, n], hash_codes [1, n, width] or None), as megahash's data stage
        and evaluation tokenise and hash it."""
        coder = self.text_coder
        ids, words = coder.encode(text)
        codes = coder.codes(ids, words) if self.needs_codes() else None
        if not return_tensors:
            return ids, codes
        tid = torch.tensor([ids], dtype=torch.long, device=self.device)
        if codes is None:
            return tid, None
        t = torch.from_numpy(codes)
        t = t if t.dtype == torch.uint8 else t.long()
        return tid, t.unsqueeze(0).to(self.device)

    def reset_kind_inputs(self) -> None:
        """Forget what the kind inputs cached (e.g. fixed-input Q/K maps; call after changing weights in eval mode)."""
        base = self.model if hasattr(self, "model") else self
        for extra in base.kind_inputs():
            extra.reset()

    reset_fixed_maps = reset_kind_inputs  # the name before kind inputs were generic


class MegahashModel(MegahashPreTrainedModel):
    """Embedding -> layers -> final norm; returns the last hidden states [b, s, h] (the heads' input: under muP
    times the readout multiplier B / hidden_size, as megahash's ``MegahashLM.hidden_states``)."""

    def __init__(self, config: MegahashConfig):
        super().__init__(config)
        self.embedding = build_embedding(config, references())
        self.decoder = Decoder(config, references())
        self.value_embeds = build_value_embeds(  # model.value_embeds (megahash/models/value_embeds.py)
            int(megahash_option(config, "model", "value_embeds", 0) or 0),
            [layer.self_attention for layer in self.decoder.layers],
            config.padded_vocab_size,
            float(
                megahash_option(config, "model", "embed_init_std", 0.0)
                or megahash_option(config, "model", "init_std", 0.02)
            ),
        )
        self.embedding_extras = RobertaEmbeddingExtras(config) if is_roberta(config) else None
        self.kind_input_attrs = list(config.kind_inputs)  # e.g. a fixed input (its buffers under model.<attr>)
        for attr, meta in config.kind_inputs.items():
            setattr(self, attr, build_kind_input(config, meta, references()))
        self.gradient_checkpointing = False  # set by transformers' gradient_checkpointing_enable()
        self.post_init()

    def kind_inputs(self) -> list:
        return [getattr(self, a) for a in self.kind_input_attrs]

    def get_input_embeddings(self):
        return getattr(self.embedding, "word_embeddings", None)

    def set_input_embeddings(self, value):
        if getattr(self.embedding, "word_embeddings", None) is None:
            raise ValueError(f"the {self.config.embedding!r} embedding has no vocabulary table")
        self.embedding.word_embeddings = value

    def forward(
        self,
        input_ids=None,
        hash_codes=None,
        attention_mask=None,
        past_key_values=None,
        use_cache=None,
        output_hidden_states=False,
        return_dict=True,
        **kwargs,
    ):
        if input_ids is None:  # e.g. inputs_embeds: every megahash model reads the ids (hash codes, value embeddings)
            raise ValueError("megahash models take input_ids (inputs_embeds is not supported)")
        b, s = input_ids.shape
        decoder = arch_of(self.config.arch).causal
        given = _given_cache(past_key_values, kwargs)
        cache = given if isinstance(given, MegahashCache) else None
        if cache is None and use_cache and decoder:
            cache = MegahashCache(len(self.decoder.layers))
        offset = cache.offset if cache is not None else 0
        key_mask = None
        if attention_mask is not None and attention_mask.dim() == 2:
            am = attention_mask[:, -s:].bool() if decoder else attention_mask.bool()
            if not decoder:
                key_mask = am
            elif not bool(am.all()):
                # causal model: right padding changes nothing before it; left padding would
                if bool((am[:, 1:] & ~am[:, :-1]).any()) or not bool(am[:, 0].all()):
                    raise ValueError(
                        "megahash decoders support right padding only; generate prompts of "
                        "different lengths one at a time (or with batch_size=1)"
                    )
        if hash_codes is None and getattr(self.embedding, "needs_codes", False):
            if offset:
                raise ValueError(
                    "pass hash_codes for the new tokens when decoding with a cache (generate() computes them)"
                )
            hash_codes = self.codes_for_ids(input_ids)  # e.g. lm-eval's hf model passes ids only
        emb = self.embedding(input_ids, hash_codes)
        for extra in self.kind_inputs():  # e.g. a token n-gram table added to the embedding
            embed = getattr(extra, "embed", None)
            emb = emb if embed is None else embed(input_ids, emb, cache)
        docs, positions = packed_documents(self.config, input_ids, offset)  # the run's data.reset_* flags
        rotary = None  # model.layout=roberta: learned positions, no RoPE
        if self.embedding_extras is not None:
            emb = self.embedding_extras(emb, key_mask, positions)
        else:  # [s, b, 1, d] with positions: each token rotated by its position in its document
            d_h = self.config.hidden_size // self.config.num_attention_heads
            rotary = rope_freqs(offset, s, d_h, self.config.rope_theta, emb.device, positions)
        x = emb.transpose(0, 1)  # the layers run sequence-first, as megatron-core's
        mask = None if key_mask is None else ~key_mask[:, None, None, :]  # megatron's: True = masked
        state = MixState(
            embeddings=x,
            offset=offset,
            tokens=input_ids,
            document_ids=docs,
            position_ids=positions,
            decode=cache,
            value_embeds=self.value_embeds,
        )
        for extra in self.kind_inputs():  # e.g. the fixed input's Q/K maps
            state.inputs.update(extra.context(self, offset + s))
        hidden = [] if output_hidden_states else None

        def layer(i, x):
            if hidden is not None:
                hidden.append(x.transpose(0, 1))
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                # the layer's activations recomputed in the backward pass (transformers' checkpoint function)
                return self._gradient_checkpointing_func(self.decoder.layers[i].__call__, x, mask, rotary, state)
            return self.decoder.layers[i](x, mask, rotary, state)

        x = self.decoder.run(x, layer)
        if self.decoder.final_layernorm is not None:
            x = self.decoder.final_layernorm(x)
        base = int(megahash_option(self.config, "model", "mup_base_hidden_size", 0) or 0)
        if base:  # muP: the heads' input times B / hidden_size (MegahashLM.hidden_states, megahash/models/mup.py)
            x = x * readout_multiplier(self.config.hidden_size, base)
        x = x.transpose(0, 1).contiguous()
        if hidden is not None:
            hidden.append(x)
        if cache is not None:
            cache.offset += s
        return BaseModelOutputWithPast(
            last_hidden_state=x, hidden_states=tuple(hidden) if hidden is not None else None, **{CACHE_FIELD: cache}
        )


class MegahashForCausalLM(MegahashPreTrainedModel, GenerationMixin):
    """Decoder with its head: vocab logits [b, s, vocab_size] (the real vocabulary; TP padding rows are
    kept in the weights but not scored), or the logits of the head kind's reference."""

    def __init__(self, config: MegahashConfig):
        super().__init__(config)
        self.model = MegahashModel(config)
        self.tied = bool(config.tie_embeddings) and getattr(self.model.embedding, "tieable", False)
        self.head = build_head(config, references())
        self.output_layer = (
            nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
            if self.head is None and not self.tied
            else None
        )
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model creates its own MegahashCache

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.output_layer

    def set_output_embeddings(self, new_embeddings):
        self.output_layer = new_embeddings

    def head_logits(self, hidden):
        if self.head is not None:
            return self.head(hidden)
        weight = self.model.embedding.weight if self.tied else self.output_layer.weight
        logits = F.linear(hidden, weight[: self.config.vocab_size])
        cap = float(megahash_option(self.config, "model", "logit_softcap", 0.0) or 0.0)
        return cap * torch.tanh(logits / cap) if cap else logits  # model.logit_softcap (megatron_model.softcap)

    def forward(
        self,
        input_ids=None,
        hash_codes=None,
        attention_mask=None,
        past_key_values=None,
        use_cache=None,
        labels=None,
        output_hidden_states=False,
        return_dict=True,
        logits_to_keep=0,
        **kwargs,
    ):
        out = self.model(
            input_ids=input_ids,
            hash_codes=hash_codes,
            attention_mask=attention_mask,
            past_key_values=_given_cache(past_key_values, kwargs),
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
        )
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.head_logits(hidden)
        loss = None
        causal = arch_of(self.config.arch).causal
        if labels is not None:
            if self.head is None:  # causal LM: position t predicts labels[t + 1]
                shift = logits[:, :-1] if causal else logits
                tgt = labels[:, 1:] if causal else labels
                loss = F.cross_entropy(shift.float().reshape(-1, shift.shape[-1]), tgt.reshape(-1), ignore_index=-100)
            elif getattr(self.head, "token_classes", 0):  # a per-token classification head (Shuffle+Random)
                loss = F.cross_entropy(
                    logits.float().reshape(-1, self.head.token_classes), labels.reshape(-1), ignore_index=-100
                )
        cls = CausalLMOutputWithPast if causal else MaskedLMOutput
        if cls is MaskedLMOutput:
            return cls(loss=loss, logits=logits, hidden_states=out.hidden_states)
        return cls(
            loss=loss, logits=logits, hidden_states=out.hidden_states, **{CACHE_FIELD: getattr(out, CACHE_FIELD)}
        )

    # -- generation -------------------------------------------------------------------------
    def _generation_codes(self, input_ids, given):
        """Codes of the whole sequence so far: the given prompt codes, then the text coder's codes
        of the generated tokens (computed over the full sequence, as megahash's evaluation does)."""
        if given is not None and given.shape[1] >= input_ids.shape[1]:
            return given[:, : input_ids.shape[1]]
        codes = self.codes_for_ids(input_ids)
        if given is not None:
            codes[:, : given.shape[1]] = given.to(codes.dtype)
        return codes

    def generate(self, *args, **kwargs):
        if self.head is not None or not arch_of(self.config.arch).causal:
            raise ValueError(
                "generate() needs a decoder with the vocabulary head; this model's head predicts "
                f"{'word-hash codes' if self.head is not None else 'masked tokens'} (use its logits)"
            )
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if (
            torch.is_tensor(input_ids)
            and torch.is_tensor(mask)
            and input_ids.shape[0] > 1
            and not bool(mask.bool().all())
        ):
            return generate_left_padded(
                self,
                super().generate,
                input_ids,
                mask,
                {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask")},
            )
        return super().generate(*args, **kwargs)

    def prepare_inputs_for_generation(
        self, input_ids, past_key_values=None, attention_mask=None, hash_codes=None, **kwargs
    ):
        cache = _given_cache(past_key_values, kwargs)
        inputs = super().prepare_inputs_for_generation(
            input_ids, attention_mask=attention_mask, **{CACHE_FIELD: cache}, **kwargs
        )
        inputs.pop("position_ids", None)
        if self.needs_codes() and self.embedding_needs_codes():
            n = inputs["input_ids"].shape[1]
            inputs["hash_codes"] = self._generation_codes(input_ids, hash_codes)[:, -n:]
        else:
            inputs.pop("hash_codes", None)
        return inputs


def _row_criteria(criteria, lead: int, pad: int, batch: int):
    """Stopping criteria built for the whole padded batch (lm-eval's ``MultiTokenEOSCriteria`` keep one flag per
    row and read the new tokens after the batch's prompt width), for one row generated alone: a copy of each
    (its per-row state copied too) that sees the row left-padded back to the batch's prompt width, as every row
    of a batch of that size, and answers for the row."""

    def fresh(c):  # a shallow copy with its containers (per-row state) copied
        new = object.__new__(type(c))
        for k, v in vars(c).items():
            if isinstance(v, (list, dict, set)):
                v = v.copy()
            elif torch.is_tensor(v):
                v = v.clone()
            setattr(new, k, v)
        return new

    class RowView(_StoppingBase):
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, input_ids, scores, **kw):
            n = input_ids.shape[0]  # this row's sequences (num_return_sequences)
            lead_ids = torch.full((n, lead), pad, dtype=input_ids.dtype, device=input_ids.device)
            reps = -(-batch // n)
            view = torch.cat([lead_ids, input_ids], dim=1).repeat(reps, 1)[:batch]
            if torch.is_tensor(scores):
                scores = scores.repeat(reps, *([1] * (scores.dim() - 1)))[:batch]
            done = self.inner(view, scores, **kw)
            if torch.is_tensor(done):
                return done.reshape(-1)[:n].bool()
            return torch.full((n,), bool(done), dtype=torch.bool, device=input_ids.device)

    return _StoppingList([RowView(fresh(c)) for c in criteria])


def generate_left_padded(model, generate, input_ids, mask, kwargs):
    """Batched ``generate()`` of padded prompts (left padding, as transformers pads for generation; or
    right): each prompt is generated without its padding (exactly the unbatched result, for every
    attention kind, including the recurrent and fixed-input ones whose states padding would
    disturb), and the rows are put back in the batch layout transformers returns: the prompts as
    given, then the new tokens, rows that stopped early filled with ``pad_token_id``. As in a batch,
    ``max_length`` counts the padded prompt width (each row gets ``max_length`` - width new tokens), and
    ``stopping_criteria`` made for the batch (lm-eval's stop sequences) see each row in the batch's layout."""
    if kwargs.get("return_dict_in_generate"):
        raise ValueError("padded batches: generate() returns token ids here (return_dict_in_generate=False)")
    gen_cfg = kwargs.get("generation_config") or model.generation_config
    pad = kwargs.get("pad_token_id", getattr(gen_cfg, "pad_token_id", None))
    if pad is None:
        pad = getattr(gen_cfg, "eos_token_id", None)
        pad = pad[0] if isinstance(pad, (list, tuple)) else (pad if pad is not None else 0)
    width = input_ids.shape[1]
    if kwargs.get("max_new_tokens") is None:
        max_length = kwargs.pop("max_length", None)
        if max_length is None and getattr(gen_cfg, "max_new_tokens", None) is None:
            max_length = getattr(gen_cfg, "max_length", None)
        if max_length is not None:  # a batch's max_length counts its padded prompts
            kwargs["max_new_tokens"] = max(int(max_length) - width, 1)
    codes = kwargs.pop("hash_codes", None)
    criteria = kwargs.pop("stopping_criteria", None)
    k = int(kwargs.get("num_return_sequences") or getattr(gen_cfg, "num_return_sequences", 1) or 1)
    rows = []
    for i in range(input_ids.shape[0]):
        keep = mask[i].bool()
        row_kwargs = dict(kwargs)
        if codes is not None:
            row_kwargs["hash_codes"] = codes[i : i + 1, keep]
        row = input_ids[i : i + 1, keep]
        if criteria:
            row_kwargs["stopping_criteria"] = _row_criteria(criteria, width - row.shape[1], int(pad), len(mask) * k)
        out = generate(row, attention_mask=torch.ones_like(row), **row_kwargs)
        rows.extend(out[:, row.shape[1] :])  # num_return_sequences rows per prompt, as transformers orders them
    new_width = max(r.shape[0] for r in rows)
    new = torch.full((len(rows), new_width), int(pad), dtype=input_ids.dtype, device=input_ids.device)
    for i, r in enumerate(rows):
        new[i, : r.shape[0]] = r
    return torch.cat([input_ids.repeat_interleave(len(rows) // input_ids.shape[0], dim=0), new], dim=1)


class MegahashForMaskedLM(MegahashForCausalLM):
    """Encoders (``model.arch=encoder``): bidirectional, ``attention_mask`` is the padding mask;
    logits of the MLM vocabulary head, or of the Shuffle+Random 3-way head."""


__all__ = ["MegahashCache", "MegahashForCausalLM", "MegahashForMaskedLM", "MegahashModel", "MegahashPreTrainedModel"]
