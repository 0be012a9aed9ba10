"""The CUDA decoder's rollout path, checked on the CPU: graphs at padded batch sizes captured once and
reused as rows finish, the fused weights read in place from a rollout skeleton, their copies counted."""

from __future__ import annotations

import pytest
import torch

from rlhf.engine import generation
from rlhf.engine.backends.base import Backend
from rlhf.engine.backends.cpu import CpuBackend
from rlhf.engine.backends.cuda import CudaBackend, kernels
from rlhf.engine.backends.cuda.decode_graph import graph_batch_sizes
from rlhf.engine.backends.cuda.decoder import CudaLlamaDecoder
from rlhf.engine.config import EngineConfig
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.fast_decode import FastLlamaDecoder, copied_projection_bytes, share_fused_storage
from rlhf.engine.generation import GenerationTooLarge, generate
from rlhf.engine.memory_plan import fused_weight_bytes, model_shape
from rlhf.engine.positions import position_ids_from_mask
from rlhf.engine.rollout import rollout_mode
from rlhf.engine.sampling import SamplingParams
from rlhf.engine.train_engine import TrainEngine
from rlhf.models.loading import load_causal_lm
from rlhf.models.tiny import build_tiny_model
from tests.test_generation import PAD, batch, tok  # noqa: F401 (the same left-padded prompts and fixtures)


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model("llama", tok, seed=0).eval()


def _eight_rows(batch) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = batch
    reps = -(-8 // ids.shape[0])
    return ids.repeat(reps, 1)[:8], mask.repeat(reps, 1)[:8]


def test_graph_batch_sizes_are_powers_of_two_and_the_rollout_batch() -> None:
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(8) == (1, 2, 4, 8)
    assert graph_batch_sizes(12) == (1, 2, 4, 8, 12)


def test_graphs_are_captured_once_per_padded_size_and_reused_as_rows_finish(model, batch, monkeypatch) -> None:
    """Rows dropped 8 -> 6 -> 3 -> 1: the step of size 8 serves 8 and 6 rows, then sizes 4 and 1 are
    added, each once; every step's logits are the eager decoder's for the same rows."""
    monkeypatch.setattr(kernels, "decode_attention_reference", None)  # a graph step without the op never upcasts
    ids, mask = _eight_rows(batch)
    b, p = ids.shape
    steps = 7
    graphed = CudaLlamaDecoder(model, b, p + steps, cuda_graph=True)
    eager = FastLlamaDecoder(model, b, p + steps)
    positions = position_ids_from_mask(mask)
    full_mask = torch.cat([mask, torch.ones(b, steps, dtype=mask.dtype)], dim=1)
    keeps = {1: [0, 1, 2, 4, 5, 7], 3: [0, 3, 5], 5: [1]}  # at these steps, the rows kept
    rows = torch.arange(b)
    sizes_seen = []
    with torch.no_grad():
        g, e = graphed.prefill(ids, mask, positions), eager.prefill(ids, mask, positions)
        for step in range(steps - 1):
            torch.testing.assert_close(g, e, atol=1e-4, rtol=0)
            if step in keeps:
                keep = torch.tensor(keeps[step])
                graphed.expand(keep)
                eager.expand(keep)
                rows, g, e = rows[keep], g[keep], e[keep]
            token = e.argmax(-1, keepdim=True)
            width, pos = p + step + 1, positions[rows, -1:] + step + 1
            g = graphed.decode(token, full_mask[rows, :width], pos)
            e = eager.decode(token, full_mask[rows, :width], pos)
            sizes_seen.append(graphed.graphs.size_for(len(rows)))
        torch.testing.assert_close(g, e, atol=1e-4, rtol=0)
    assert sizes_seen == [8, 8, 8, 4, 4, 1]
    assert sorted(graphed.graphs.graphs) == [1, 4, 8]


def test_group_sampling_expansion_allocates_a_new_cache_and_new_graphs(model, batch) -> None:
    ids, mask = batch
    params = SamplingParams(max_new_tokens=6, pad_token_id=PAD, do_sample=False)
    decoder = CudaLlamaDecoder(model, ids.shape[0], ids.shape[1] + 6, cuda_graph=True)
    old = decoder._key_buffers[0]
    decoder.expand(torch.arange(ids.shape[0]).repeat_interleave(2))
    assert decoder._key_buffers[0] is not old and decoder._key_buffers[0].shape[0] == 2 * ids.shape[0]
    assert decoder.graphs is None
    assert generate(model, ids, mask, params, fast=True).sequences.shape[0] == ids.shape[0]


def test_a_rollout_skeleton_holds_the_fused_weights_the_cuda_decoder_reads_in_place(tok, batch) -> None:
    model = build_tiny_model("llama", tok, seed=0).eval()
    ids, mask = batch
    params = SamplingParams(max_new_tokens=8, pad_token_id=PAD, do_sample=False)
    before = generate(model, ids, mask, params, fast=True).sequences
    assert copied_projection_bytes(model, transpose_copies=False) > 0  # separate storages: a copy each
    assert share_fused_storage(model) == len(model.model.layers)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.v_proj.weight.untyped_storage().data_ptr()
    assert [name for name, _ in model.named_parameters()] == [name for name, _ in
                                                              build_tiny_model("llama", tok, seed=0).named_parameters()]
    assert copied_projection_bytes(model, transpose_copies=False) == 0
    assert copied_projection_bytes(model, transpose_copies=True) > 0
    decoder = CudaLlamaDecoder(model, ids.shape[0], ids.shape[1] + 8)
    wqkv = decoder.layers[0].wqkv_t
    assert wqkv.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
    assert torch.equal(generate(model, ids, mask, params, fast=True).sequences, before)


def test_the_rollout_skeleton_shares_fused_storage(tiny_model_dirs) -> None:
    """rollout_mode at tp=1 builds its skeleton with q/k/v and gate/up rows side by side: the CUDA
    decoder copies no weight; the rollout generates as the trained model does."""
    engine = TrainEngine(load_causal_lm(str(tiny_model_dirs["llama"])), EngineConfig(dtype="fp32", micro_batch_size=2),
                         DistributedContext.initialize(), total_steps=1, name="actor")
    prompts = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    mask = (prompts != 0).long()
    params = SamplingParams(max_new_tokens=5, pad_token_id=0, do_sample=False)
    with rollout_mode(engine) as rollout:
        assert copied_projection_bytes(rollout.model, transpose_copies=False) == 0
        assert CudaBackend().decoder_weight_bytes(rollout.model) == 0 < CpuBackend().decoder_weight_bytes(rollout.model)
        out = rollout.generate(prompts, mask, params)
        assert rollout.parity_max_diff is not None and rollout.parity_max_diff < 1e-4
    engine.model.eval()
    assert torch.equal(out.sequences, generate(engine.model, prompts, mask, params, fast=False).sequences)


def test_the_plan_and_the_fit_check_count_the_decoders_weight_copies(tok, batch, monkeypatch) -> None:
    model = build_tiny_model("llama", tok, seed=0).eval()
    shape = model_shape(model.config)
    fused = fused_weight_bytes(shape, 4)
    assert fused > 0
    assert Backend().decode_weight_copies(shape, 4) == {"fused weights": fused}
    assert CpuBackend().decode_weight_copies(shape, 4)["fused weights"] == fused
    assert CudaBackend().decode_weight_copies(shape, 4) == {"fused weights": 0}
    ids, mask = batch
    copies = copied_projection_bytes(model, transpose_copies=True)
    cache = generation.kv_cache_bytes(model.config, ids.shape[0], ids.shape[1] + 4, torch.float32)
    monkeypatch.setattr(generation, "available_memory_bytes", lambda device: cache + copies // 2)
    params = SamplingParams(max_new_tokens=4, pad_token_id=PAD, do_sample=False)
    with pytest.raises(GenerationTooLarge, match="the fast decoder's weight copies"):
        generate(model, ids, mask, params, fast=True)
    assert generate(model, ids, mask, params, fast=False).sequences.shape[1] == ids.shape[1] + 4


def test_the_cuda_backend_swaps_no_module_and_builds_no_cpu_op(model, monkeypatch) -> None:
    """A GPU model keeps Hugging Face's modules (the fused layers are the CPU backend's) and its decoder
    loads no CPU op."""
    from rlhf.engine import ops

    loaded: list[str] = []
    monkeypatch.setattr(ops, "load_op", lambda name: loaded.append(name))
    classes = [type(m) for m in model.modules()]
    assert CudaBackend().prepare_model(model) == {}
    CudaBackend().fast_decoder(model, 2, 8)
    assert [type(m) for m in model.modules()] == classes and loaded == []
