"""Training steps replayed as CUDA graphs: bucket shapes and bad arguments (CPU), and on the GPU
the same weights as eager steps on the same padded batches, compiled blocks included."""
from __future__ import annotations

import pytest
import torch

from gemcore.config import AttentionConfig, ModelConfig
from gemcore.cuda_graphs import Buckets, GraphedTrainStep
from gemcore.data import make_synthetic
from gemcore.data.padding import pad_batch
from gemcore.kernels.jagged_attention import make_attention
from gemcore.model import GemModel


def data(users=64, max_len=300):
    return make_synthetic(num_users=users, num_items=500, num_actions=4, max_len=max_len, num_candidates=4,
                          num_clusters=8, kind="heavytail", seed=0)


def test_bucket_shape_rounds_up_and_covers_the_padding_users():
    batch = data().__getitems__(list(range(10)))
    T, C = batch.item_ids.numel(), batch.cand_ids.numel()
    events, candidates, users, max_len = Buckets(events=64, candidates=16, padding_users=4).shape_of(batch)
    assert events % 64 == 0 and T <= events < T + 64
    assert candidates % 16 == 0 and C <= candidates < C + 16
    assert users == 16 and max_len >= max(batch.max_len, 128) and max_len & (max_len - 1) == 0
    padded = pad_batch(batch, num_events=events, num_candidates=candidates, num_users=users)
    assert padded.max_len <= max_len


@pytest.mark.parametrize("field", ["events", "candidates", "padding_users"])
def test_bad_buckets_are_named(field):
    with pytest.raises(ValueError, match=f"Buckets.{field} must be a positive int, got 0"):
        Buckets(**{field: 0})


def test_optimizer_without_capturable_is_refused():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="optimizer: param group 0 has capturable=False"):
        GraphedTrainStep(lambda b: p.sum(), torch.optim.AdamW([p], capturable=False))
    with pytest.raises(ValueError, match="max_graphs must be a positive int"):
        GraphedTrainStep(lambda b: p.sum(), torch.optim.AdamW([p], capturable=True), max_graphs=0)


def gpu_model(compile_blocks: bool) -> GemModel:
    torch.manual_seed(0)
    cfg = ModelConfig(hidden=64, num_heads=2, num_blocks=2, num_items=500)
    model = GemModel(cfg, make_attention(AttentionConfig())).cuda()
    if compile_blocks:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, dynamic=True)
    return model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile_blocks", [False, True])
def test_graph_replays_train_as_eager_steps_on_the_padded_batches(compile_blocks):
    dataset = data()
    batches = [dataset.__getitems__(list(range(8 * i, 8 * i + 8))).to("cuda") for i in range(7)]
    buckets = Buckets(events=128, candidates=16, padding_users=4)
    graphed_model, eager_model = gpu_model(compile_blocks), gpu_model(compile_blocks)

    def loss_fn(model):
        def loss(batch):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return model.loss(batch)
        return loss

    graphed_opt = torch.optim.AdamW(graphed_model.parameters(), lr=1e-3, fused=True, capturable=True)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3, fused=True, capturable=True)
    step = GraphedTrainStep(loss_fn(graphed_model), graphed_opt, buckets)
    for i, batch in enumerate(batches):
        loss = step(batch)
        shape = buckets.shape_of(batch)
        padded = pad_batch(batch, num_events=shape[0], num_candidates=shape[1], num_users=shape[2])
        padded.max_len = shape[3]
        eager_opt.zero_grad(set_to_none=False)
        eager_loss = loss_fn(eager_model)(padded)
        eager_loss.backward()
        eager_opt.step()
        torch.testing.assert_close(loss, eager_loss.detach(), rtol=1e-5, atol=1e-6, msg=f"loss of step {i}")
    torch.cuda.synchronize()
    assert step.eager_steps == 1 and step.replays == len(batches) - 1 and 1 <= len(step.graphs) <= len(batches) - 1
    assert 0 < step.padding_fraction < 0.9
    for (name, a), b in zip(graphed_model.named_parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=f"{name}.grad")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prepare_captures_without_training_and_a_host_sync_is_refused():
    model = gpu_model(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    dataset = data()
    first, second = (dataset.__getitems__(list(range(8 * i, 8 * i + 8))).to("cuda") for i in range(2))
    step = GraphedTrainStep(model.loss, opt)
    with pytest.raises(RuntimeError, match="take one step first"):
        step.prepare(first)
    step(first)
    before = [p.detach().clone() for p in model.parameters()]
    step.prepare(second)
    assert len(step.graphs) == 1 and all(torch.equal(a, p) for a, p in zip(before, model.parameters()))

    def syncing_loss(batch):
        loss = model.loss(batch)
        loss.item()
        return loss

    bad = GraphedTrainStep(syncing_loss, opt, Buckets(events=4096))
    with pytest.raises(RuntimeError, match="could not be captured as a CUDA graph"):
        bad(second)
