"""Training steps replayed as CUDA graphs: bucket shapes and bad arguments (CPU), and on the GPU
the same weights as eager steps on the same padded batches, compiled blocks included."""
from __future__ import annotations

import pytest
import torch

from gemcore.config import AttentionConfig, ModelConfig
from gemcore.cuda_graphs import Buckets, GraphedForwardBackward
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
    shape, same = Buckets(events=64, candidates=16, padding_users=4).pad(batch)
    assert shape == (events, candidates, users, max_len) and same.max_len == max_len
    assert same.offsets.equal(padded.offsets)


@pytest.mark.parametrize("field", ["events", "candidates", "padding_users"])
def test_bad_buckets_are_named(field):
    with pytest.raises(ValueError, match=f"Buckets.{field} must be a positive int, got 0"):
        Buckets(**{field: 0})


def test_bad_arguments_are_named():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="max_graphs must be a positive int"):
        GraphedForwardBackward(lambda b: p.sum(), [p], max_graphs=0)
    with pytest.raises(TypeError, match="buckets must be a Buckets"):
        GraphedForwardBackward(lambda b: p.sum(), [p], buckets=(1024, 256, 16))
    with pytest.raises(ValueError, match="params: no parameter requires a gradient"):
        GraphedForwardBackward(lambda b: p.sum(), [torch.nn.Parameter(torch.zeros(2), requires_grad=False)])


def gpu_model(compile_blocks: bool) -> GemModel:
    torch.manual_seed(0)
    cfg = ModelConfig(hidden=64, num_heads=2, num_blocks=2, num_items=500)
    model = GemModel(cfg, make_attention(AttentionConfig())).cuda()
    if compile_blocks:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, dynamic=True)
    return model


def bf16_loss(model):
    def loss(batch):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model.loss(batch)
    return loss


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile_blocks, max_graphs", [(False, 16), (True, 16), (False, 1)])
def test_graph_replays_train_as_eager_steps_on_the_padded_batches(compile_blocks, max_graphs):
    """7 steps over several buckets; max_graphs=1: the batches of other buckets run eagerly."""
    dataset = data()
    batches = [dataset.__getitems__(list(range(8 * i, 8 * i + 8))).to("cuda") for i in range(7)]
    buckets = Buckets(events=128, candidates=16, padding_users=4)
    graphed_model, eager_model = gpu_model(compile_blocks), gpu_model(compile_blocks)
    graphed_opt = torch.optim.AdamW(graphed_model.parameters(), lr=1e-3, fused=True)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3, fused=True)
    graphed = GraphedForwardBackward(bf16_loss(graphed_model), graphed_model.parameters(), buckets, max_graphs)
    for i, batch in enumerate(batches):
        loss = graphed(batch)
        graphed_opt.step()
        _, padded = buckets.pad(batch)
        eager_opt.zero_grad(set_to_none=True)
        eager_loss = bf16_loss(eager_model)(padded)
        eager_loss.backward()
        eager_opt.step()
        torch.testing.assert_close(loss, eager_loss.detach(), rtol=1e-5, atol=1e-6, msg=f"loss of step {i}")
    torch.cuda.synchronize()
    shapes = {buckets.shape_of(b) for b in batches}
    assert len(shapes) > 1 and len(graphed.graphs) == min(max_graphs, len(shapes))
    assert graphed.replays + graphed.eager_steps == len(batches) and (graphed.eager_steps > 0) == (max_graphs == 1)
    assert 0 < graphed.padding_fraction < 0.9
    for (name, a), b in zip(graphed_model.named_parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=f"{name}.grad")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prepare_captures_without_training_and_a_host_sync_is_refused():
    model = gpu_model(False)
    dataset = data()
    first, second = (dataset.__getitems__(list(range(8 * i, 8 * i + 8))).to("cuda") for i in range(2))
    graphed = GraphedForwardBackward(model.loss, model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    graphed.prepare(second)
    assert len(graphed.graphs) == 1 and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    loss = graphed(second)
    model.zero_grad(set_to_none=True)
    _, padded = graphed.buckets.pad(second)
    reference = model.loss(padded)
    torch.testing.assert_close(loss, reference.detach(), rtol=1e-5, atol=1e-6)

    def syncing_loss(batch):
        loss = model.loss(batch)
        loss.item()
        return loss

    bad = GraphedForwardBackward(syncing_loss, model.parameters())
    with pytest.raises(RuntimeError, match="could not be captured as a CUDA graph"):
        bad(first)


def tiny_config(tmp_path, name, extra):
    from conftest import TINY

    from gemcore.config import load_config

    return load_config(None, [*TINY, f"run.out_dir='{tmp_path}'", f"run.name='{name}'", "run.max_steps=6",
                              "run.log_every=1", *extra])


def test_trainer_refuses_cuda_graphs_off_the_gpu(tmp_path):
    from gemcore.plugin_manager import create_plugin_manager
    from gemcore.trainer import run_training

    with pytest.raises(ValueError, match="train.cuda_graphs: it needs a CUDA device"):
        run_training(tiny_config(tmp_path, "cpu", ["run.device='cpu'", "train.cuda_graphs=true"]),
                     create_plugin_manager())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_trainer_with_cuda_graphs_follows_the_eager_losses(tmp_path):
    """gem train with train.cuda_graphs: the same per-step losses as without, up to the padding's
    rounding (bf16 GEMMs over more rows), and every step after a bucket's capture a replay."""
    import json

    from gemcore.plugin_manager import create_plugin_manager
    from gemcore.trainer import run_training

    losses = {}
    for graphs in (False, True):
        config = tiny_config(tmp_path, f"g{graphs}", ["run.device='cuda'", "model.hidden=64",
                                                      f"train.cuda_graphs={str(graphs).lower()}"])
        summary, run_dir = run_training(config, create_plugin_manager())
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        losses[graphs] = [r["loss"] for r in rows if "loss" in r]
    assert summary["cuda_graphs"]["replays"] == 6 and summary["cuda_graphs"]["graphs"] >= 1
    assert len(losses[True]) == 6
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=2e-2, atol=1e-3)
