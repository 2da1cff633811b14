"""The static-shape decoder shared by every family, and its per-graph wrappers for compilation.

Parameter names equal transformers' (``model.layers.0.self_attn.q_proj.weight``, ...), so the
weight map is the identity plus strict checks (see `optimum.neuron.weights`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..graphs import GraphKind, GraphSpec
from .family import Family, layer_windows
from .layers.attention import (
    Attention,
    AttentionContext,
    AttentionOptions,
    ChunkContext,
    DecodeContext,
    MixedContext,
    VerifyContext,
    attention_dims,
    kept_rows,
)
from .layers.embedding import ScaledEmbedding
from .layers.lora import AdapterRows, selected_adapters
from .layers.mlp import FusedGatedMLP, GatedMLP
from .layers.packed import head_logits
from .layers.rope import Rotary, RotaryPerType
from .layers.sampling import sample_tokens
from .layers.splice import splice_image_rows

ImageRows = tuple[torch.Tensor, torch.Tensor]
"""An image-text prefill chunk's ``image_embeds [1, T, H]`` and ``image_mask [1, T]`` (`layers.splice`)."""


def attention_of(family: Family, hf_config: Any, index: int) -> Attention:
    """Layer ``index``'s attention: the family's biases, q/k norm, fused projection, scale and window."""
    eps = hf_config.rms_norm_eps
    options = AttentionOptions(
        qkv_bias=family.qkv_bias(hf_config),
        o_bias=family.o_bias(hf_config),
        qk_norm=(lambda size: family.norm(size, eps)) if family.qk_norm else None,
        fused_qkv=family.fused_qkv,
        scale=family.attention_scale(hf_config),
        window=layer_windows(family, hf_config)[index],
    )
    return Attention(attention_dims(hf_config), options)


def dense_mlp(family: Family, hf_config: Any) -> nn.Module:
    """The gated MLP of ``intermediate_size`` (fused gate/up for families whose checkpoints fuse it)."""
    hidden, intermediate = hf_config.hidden_size, hf_config.intermediate_size
    if family.fused_qkv:
        return FusedGatedMLP(hidden, intermediate, hf_config.hidden_act)
    return GatedMLP(hidden, intermediate, hf_config.hidden_act, bias=bool(getattr(hf_config, "mlp_bias", False)))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual."""

    def __init__(self, family: Family, hf_config: Any, index: int) -> None:
        super().__init__()
        eps, hidden = hf_config.rms_norm_eps, hf_config.hidden_size
        self.layer_type = family.layer_types(hf_config)[index]
        self.input_layernorm = family.norm(hidden, eps)
        self.self_attn = attention_of(family, hf_config, index)
        self.post_attention_layernorm = family.norm(hidden, eps)
        self.mlp = family.mlp(hf_config, index) if family.mlp else dense_mlp(family, hf_config)

    def forward(
        self,
        h: torch.Tensor,
        rope: Any,
        caches: list[torch.Tensor],
        ctx: AttentionContext,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``h [B, T, hidden]`` -> ``[B, T, hidden]``, or only the tokens ``rows`` past the attention (`kept_rows`)."""
        h = kept_rows(h, rows) + self.self_attn(self.input_layernorm(h), rope, caches, ctx, rows)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderBody(nn.Module):
    """Embeddings, layers, final norm and rotary frequencies (transformers' ``model.`` prefix)."""

    def __init__(self, family: Family, hf_config: Any) -> None:
        super().__init__()
        vocab, hidden, scale = hf_config.vocab_size, hf_config.hidden_size, family.embed_scale(hf_config)
        self.embed_tokens = nn.Embedding(vocab, hidden) if scale is None else ScaledEmbedding(vocab, hidden, scale)
        build = family.layer or DecoderLayer
        self.layers = nn.ModuleList(build(family, hf_config, i) for i in range(hf_config.num_hidden_layers))
        self.norm = family.norm(hidden, hf_config.rms_norm_eps)
        with torch.device("cpu"):  # real frequencies even when the rest is built on the meta device
            hf_rotary = family.rotary(hf_config)
            types = family.layer_types(hf_config)
            self.rotary_emb = RotaryPerType(hf_rotary, types) if family.rope_per_layer_type else Rotary(hf_rotary)


class StaticDecoder(nn.Module):
    """A causal LM with static shapes whose forward runs one named graph kind."""

    def __init__(self, family: Family, hf_config: Any, max_topk: int) -> None:
        super().__init__()
        self.family = family
        self.max_topk = max_topk
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = DecoderBody(family, hf_config)
        self.windows = sorted({w for w in layer_windows(family, hf_config) if w is not None})
        self.softcap = family.logit_softcap(hf_config)
        self.paged_attention = False
        """Attend with the CPU kernels: token generation and verification rows with the paged one, prefill chunks
        with the chunk one (set for the graphs: `artifact.graph_decoder`)."""
        self.cpu_candidates = False
        """On-device sampling takes its candidates from the CPU kernel (`kernels.candidates`; set for the graphs:
        `artifact.graph_decoder`)."""
        self.adapter_rows: AdapterRows | None = None
        """Multi-LoRA: the rows' adapter slots its LoRA projections read (`layers.lora.add_lora`); None without."""
        self.vocab_size = int(hf_config.vocab_size)
        self.lm_head: nn.Linear | None = None
        if not self.tied:
            self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = self.model.norm(h)
        logits = head_logits(self.model.embed_tokens if self.lm_head is None else self.lm_head, h)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.to(torch.float32)

    def _hidden(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        kv_cache: list[torch.Tensor],
        ctx,
        image_rows: ImageRows | None = None,
        rows: torch.Tensor | None = None,
    ):
        """The last layer's hidden states ``[B, T, hidden]``, or only at the token indices ``rows`` (the rows whose
        logits the graph returns: the last layer skips the others past its attention, `kept_rows`)."""
        h = self.model.embed_tokens(input_ids)
        if image_rows is not None:
            h = splice_image_rows(h, *image_rows)
        rope = self.model.rotary_emb(position_ids, h.dtype)  # one (cos, sin), or one per layer type
        per = len(kv_cache) // len(self.model.layers)  # [K, V], or an int8 cache's [K, V, K scales, V scales]
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            layer_rope = rope[layer.layer_type] if isinstance(rope, dict) else rope
            h = layer(h, layer_rope, kv_cache[per * i : per * i + per], ctx, rows if i == last else None)
        return h

    def forward(
        self,
        spec: GraphSpec,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: list[torch.Tensor],
        block_table: torch.Tensor | None,
        image_rows: ImageRows | None = None,
        adapter_ids: torch.Tensor | None = None,
        wants_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run graph ``spec.kind`` (with multi-LoRA, each row on its adapter slot ``adapter_ids [rows]``): each token
        writes its K/V at cache row ``slot_mapping`` and reads its sequence's earlier positions through ``block_table``
        (the blocks of the call's KV window; ``None``: the graph reads no earlier cache). Prefill kinds return
        last-real-token logits ``[1, V]`` (every column's ``[T, V]`` for an ``all_rows`` graph), splicing ``image_rows``
        in when given; token generation returns logits ``[B, V]`` (sampling is applied by `TokenGenerationGraph`);
        verification, each row's tokens attending like a chunk of its own sequence, returns every column's logits ``[B,
        K + 1, V]`` (packed, `GraphSpec.packed`: ``[1, N, V]``, each column reading the blocks of its own row of
        ``block_table [N, W / block_size]``). A chunked-prefill graph given ``wants_logits [1]`` False returns zeros
        in place of the logits, without computing them (`_logits_when`; on XLA it computes them)."""
        block = spec.block_size
        if spec.kind is GraphKind.TOKEN_GENERATION:
            assert block_table is not None, "token generation reads the cache"
            ctx: AttentionContext = DecodeContext.build(
                position_ids, slot_mapping, block_table, block, self.windows, self.paged_attention
            )
            with selected_adapters(self.adapter_rows, adapter_ids):
                h = self._hidden(input_ids, position_ids, kv_cache, ctx)
            return self._logits(h[:, -1])
        if spec.kind is GraphKind.VERIFICATION and self.paged_attention:
            assert block_table is not None, "verification reads the cache"
            ctx = VerifyContext.build(position_ids, slot_mapping, block_table, block, self.windows, spec.packed)
        else:
            ctx = ChunkContext.build(position_ids, slot_mapping, block_table, block, self.windows, self.paged_attention)
        # verification: every column of every row; prompt logprobs (all_rows): every column; the runtime keeps the
        # real ones. Otherwise the last real token's (invariant 5: max position), the only row the last layer computes.
        every = spec.kind is GraphKind.VERIFICATION or spec.all_rows
        last = None if every else torch.argmax(position_ids[0]).reshape(1)
        with selected_adapters(self.adapter_rows, adapter_ids):
            h = self._hidden(input_ids, position_ids, kv_cache, ctx, image_rows, rows=last)
        if wants_logits is not None:
            return self._logits_when(wants_logits, h[0])
        return self._logits(h if spec.kind is GraphKind.VERIFICATION else h[0])

    def _logits_when(self, wanted: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """`_logits` of ``h [rows, hidden]`` when ``wanted [1]`` (bool) is True, else float32 zeros of their shape,
        without the LM head: a prefill chunk before its prompt's last, whose logits the runtime drops. The head reads
        every weight of the vocabulary's rows (SmolLM2's tied embedding: 113 MB fp32, ~3-5 ms of a 256-token chunk on
        2 cores). An exported graph branches with `torch.cond` (both branches compiled, one run per call); an eager
        call reads the flag; a graph traced on an XLA device computes the logits whatever the flag (the trace must not
        read an input's value: that would run on the host and compile a graph of its own)."""

        def skipped(x: torch.Tensor) -> torch.Tensor:
            return x.new_zeros(x.shape[0], self.vocab_size, dtype=torch.float32)

        if h.device.type == "xla":
            return self._logits(h)
        if torch.compiler.is_exporting() or torch.compiler.is_compiling():
            return torch.cond(wanted[0], self._logits, skipped, (h,))
        return self._logits(h) if bool(wanted[0]) else skipped(h)

    def mixed(
        self,
        spec: GraphSpec,
        decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        chunk: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        kv_cache: list[torch.Tensor],
    ) -> torch.Tensor:
        """The mixed graph: ``decode`` = token generation's ``(input_ids, position_ids, slot_mapping [B, 1],
        block_table [B, nb])`` and ``chunk`` = one chunk's ``(ids, positions, slots [1, T], block_table [1, nb'])`` as
        one row of ``B + T`` tokens through the linear layers, each part attending as its own graph does
        (`MixedContext`). Returns the logits of the ``B`` decode rows, then of the chunk's last real token
        (invariant 5): ``[B + 1, V]``."""
        ids, positions, slots, table = decode
        chunk_ids, chunk_positions, chunk_slots, chunk_table = chunk
        rows, block, kernel = ids.shape[0], spec.block_size, self.paged_attention
        ctx = MixedContext(
            DecodeContext.build(positions, slots, table, block, self.windows, kernel),
            ChunkContext.build(chunk_positions, chunk_slots, chunk_table, block, self.windows, kernel),
            rows,
        )
        tokens = torch.cat((ids.reshape(1, rows), chunk_ids), dim=1)
        last = rows + torch.argmax(chunk_positions[0]).reshape(1)  # invariant 5: the chunk's max position
        kept = torch.cat((torch.arange(rows, device=tokens.device), last))  # the rows the last layer computes
        h = self._hidden(
            tokens, torch.cat((positions.reshape(1, rows), chunk_positions), dim=1), kv_cache, ctx, rows=kept
        )
        return self._logits(h[0])


class _Graph(nn.Module):
    """A graph's module: shares the decoder's submodules, so its weight names equal the decoder's."""

    def __init__(self, decoder: StaticDecoder, spec: GraphSpec) -> None:
        super().__init__()
        self.model, self.lm_head = decoder.model, decoder.lm_head
        self.spec = spec
        self.max_topk = decoder.max_topk
        self._decoder = [decoder]  # a list: not registered as a submodule (no "decoder." prefix)

    @property
    def decoder(self) -> StaticDecoder:
        return self._decoder[0]


class PrefillGraph(_Graph):
    """Exportable signature of the context-encoding and chunked-prefill graphs of a text artifact, and of the
    verification graph (the same inputs, ``[batch_size, K + 1]``, with a block table)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: list[torch.Tensor],
        block_table: torch.Tensor | None = None,
        adapter_ids: torch.Tensor | None = None,
        wants_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.decoder(
            self.spec, input_ids, position_ids, slot_mapping, kv_cache, block_table, None, adapter_ids, wants_logits
        )


class ImagePrefillGraph(_Graph):
    """Exportable signature of an image-text artifact's prefill graphs: the chunk's image rows come before the
    cache (`GraphSpec.images`, `graphs.graph_args`) and are spliced over the token embeddings."""

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        slot_mapping: torch.Tensor,
        image_embeds: torch.Tensor,
        image_mask: torch.Tensor,
        kv_cache: list[torch.Tensor],
        block_table: torch.Tensor | None = None,
        adapter_ids: torch.Tensor | None = None,
        wants_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        images = (image_embeds, image_mask)
        return self.decoder(
            self.spec, input_ids, position_ids, slot_mapping, kv_cache, block_table, images, adapter_ids, wants_logits
        )


class TokenGenerationGraph(_Graph):
    """Exportable signature of the token-generation graph, with or without on-device sampling."""

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: list[torch.Tensor],
        block_table: torch.Tensor,
        temperature: torch.Tensor | None = None,
        top_k: torch.Tensor | None = None,
        top_p: torch.Tensor | None = None,
        uniforms: torch.Tensor | None = None,
        adapter_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        logits = self.decoder(
            self.spec, input_ids, position_ids, slot_mapping, kv_cache, block_table, None, adapter_ids
        )
        if not self.spec.samples_on_device:
            return logits
        assert temperature is not None and top_k is not None and top_p is not None and uniforms is not None
        kernel = self.decoder.cpu_candidates
        return sample_tokens(logits, temperature, top_k, top_p, uniforms, self.max_topk, kernel=kernel)


class MixedGraph(_Graph):
    """Exportable signature of the mixed graph (``--mixed_batch``): token generation's inputs, then one chunk's
    (`graphs.MIXED_CHUNK_INPUTS`), the KV cache, and the two block tables."""

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        slot_mapping: torch.Tensor,
        chunk_ids: torch.Tensor,
        chunk_positions: torch.Tensor,
        chunk_slots: torch.Tensor,
        kv_cache: list[torch.Tensor],
        block_table: torch.Tensor,
        chunk_table: torch.Tensor,
    ) -> torch.Tensor:
        decode = (input_ids, position_ids, slot_mapping, block_table)
        return self.decoder.mixed(self.spec, decode, (chunk_ids, chunk_positions, chunk_slots, chunk_table), kv_cache)


def graph_module(decoder: StaticDecoder, spec: GraphSpec) -> nn.Module:
    """The module to trace or run for graph ``spec.kind``."""
    if spec.kind is GraphKind.MIXED:
        return MixedGraph(decoder, spec)
    if spec.kind is GraphKind.VISION_ENCODER:
        from .vision import VisionEncoderGraph

        return VisionEncoderGraph(decoder)
    if spec.kind is GraphKind.TOKEN_GENERATION:
        return TokenGenerationGraph(decoder, spec)
    return ImagePrefillGraph(decoder, spec) if spec.images else PrefillGraph(decoder, spec)
