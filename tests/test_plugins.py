"""The plugin core: entry-point discovery for real, disabling, broken plugins, name clashes."""
from __future__ import annotations

import json
from pathlib import Path

import pluggy
import pytest
import torch
from conftest import gem, run_gem, tiny_set_args

from gemcore.config import AttentionConfig
from gemcore.hookspecs import hookimpl
from gemcore.plugin_manager import GemPluginManager, PluginError, create_plugin_manager

TOY_PLUGIN = '''
from gemcore.hookspecs import hookimpl
from gemcore.kernels.jagged_attention import make_attention

CALLS = []

@hookimpl
def gemcore_attention_impls():
    def factory(config):
        inner = make_attention(config, backend="reference")
        def attend(q, k, v, offsets, **kw):
            CALLS.append(q.shape[0])
            print("toy-attention-called", flush=True)
            return inner(q, k, v, offsets, **kw)
        return attend
    return {"toy": factory}
'''


def make_distribution(root: Path, dist: str, entry: str, module: str, source: str) -> Path:
    """A minimal installed distribution on ``root``: a module plus dist-info with entry_points.txt."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[gemcore.plugins]\n{entry} = {module}\n")
    return root


@pytest.fixture
def toy_dist(tmp_path, monkeypatch):
    root = make_distribution(tmp_path / "site", "toyplug", "toy_attention", "toyplug_mod", TOY_PLUGIN)
    monkeypatch.syspath_prepend(str(root))
    return root


def test_builtin_plugins_come_from_entry_points():
    manager = create_plugin_manager()
    assert AttentionConfig().impl == "auto"                     # the default is a built-in
    for point, name in [("attention", "auto"), ("attention", "reference"), ("precision", "fp32"), ("precision", "bf16"),
                        ("parallelism", "single"), ("data", "random")]:
        impl = manager.resolve(point, name)
        assert impl.distribution == "gemcore", (point, name, impl)


def test_third_party_distribution_is_discovered_and_used_by_the_model(toy_dist):
    from gemcore.config import ModelConfig
    from gemcore.data import make_synthetic
    from gemcore.model import GemModel

    manager = create_plugin_manager()
    impl = manager.resolve("attention", "toy")
    assert (impl.plugin, impl.distribution) == ("toy_attention", "toyplug")
    cfg = ModelConfig(hidden=8, num_heads=2, num_blocks=2, num_items=32)
    model = GemModel(cfg, impl.factory(AttentionConfig()))
    data = make_synthetic(num_users=5, num_items=32, num_actions=4, max_len=8, num_candidates=2,
                          num_clusters=4, seed=0)
    model(data.__getitems__([0, 1, 2]))
    import toyplug_mod

    assert len(toyplug_mod.CALLS) == 2  # one call per block


def test_cli_trains_with_a_third_party_implementation(toy_dist, tmp_path, monkeypatch):
    result = run_gem(["train", "--name", "toy", "--max-steps", "2", "--quiet", "--set",
                      "attention.impl=toy", *tiny_set_args()], cwd=tmp_path,
                     env_extra={"PYTHONPATH": str(toy_dist)})
    assert result.returncode == 0, result.stderr
    assert "toy-attention-called" in result.stdout
    listing = gem(["plugins", "--json"], tmp_path, monkeypatch)
    info = json.loads(listing.stdout)
    impls = {i["name"]: i for i in info["hook_points"]["attention"]["implementations"]}
    assert impls["toy"]["distribution"] == "toyplug" and impls["toy"]["plugin"] == "toy_attention"
    assert any(p["name"] == "toy_attention" for p in info["plugins"])


def test_disable_by_config_and_by_environment(toy_dist, monkeypatch):
    manager = create_plugin_manager(disable=["toy_attention"])
    assert "toy" not in manager.implementations("attention")
    with pytest.raises(PluginError, match="toy"):
        manager.resolve("attention", "toy")
    monkeypatch.setenv("GEMCORE_DISABLE_PLUGINS", "toy_attention, data_random")
    manager = create_plugin_manager()
    assert "toy" not in manager.implementations("attention")
    assert "random" not in manager.implementations("data")


def test_disable_through_the_cli_config(toy_dist, tmp_path, monkeypatch):
    result = gem(["train", "--max-steps", "1", "--quiet", "--set", "attention.impl=toy",
                  "--set", "plugins.disable=['toy_attention']", *tiny_set_args()], tmp_path, monkeypatch)
    assert result.returncode == 2
    assert "attention.impl" in result.stderr and "toy" in result.stderr
    assert "Traceback" not in result.stderr


def test_broken_plugin_warns_and_the_cli_goes_on(tmp_path, monkeypatch):
    root = make_distribution(tmp_path / "site", "brokenplug", "broken", "brokenplug_mod",
                             "raise ImportError('needs libfoo')\n")
    monkeypatch.syspath_prepend(str(root))
    with pytest.warns(RuntimeWarning, match=r"'broken'.*brokenplug.*needs libfoo"):
        manager = create_plugin_manager()
    assert "reference" in manager.implementations("attention")
    with pytest.warns(RuntimeWarning):
        ok = gem(["plugins"], tmp_path, monkeypatch)
    assert ok.returncode == 0 and "broken" in ok.stdout
    with pytest.warns(RuntimeWarning):
        bad = gem(["train", "--quiet", "--max-steps", "1", "--set", "attention.impl=fancy",
                   *tiny_set_args()], tmp_path, monkeypatch)
    assert bad.returncode == 2
    assert "fancy" in bad.stderr and "broken" in bad.stderr and "needs libfoo" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_two_plugins_offering_one_name_is_an_error():
    class A:
        @hookimpl
        def gemcore_samplers(self):
            return {"same": object}

    class B(A):
        pass

    manager = GemPluginManager()
    manager.register(A(), name="a")
    manager.register(B(), name="b")
    with pytest.raises(PluginError, match="'same'.*'a'.*'b'|'same'.*'b'.*'a'"):
        manager.implementations("data")


def test_misspelt_hook_is_rejected_at_registration():
    class Typo:
        @hookimpl
        def gemcore_attention_impl(self):  # missing the trailing 's'
            return {}

    with pytest.raises(pluggy.PluginValidationError):
        GemPluginManager().register(Typo(), name="typo")


def test_lifecycle_hooks_are_called(tmp_path):
    from gemcore.config import load_config
    from gemcore.trainer import run_training

    seen = {"configure": 0, "steps": [], "end": None}

    class Recorder:
        @hookimpl
        def gemcore_configure(self, config):
            seen["configure"] += 1

        @hookimpl
        def gemcore_after_step(self, step, metrics):
            seen["steps"].append((step, metrics["loss"]))

        @hookimpl
        def gemcore_end_run(self, summary):  # a subset of the spec's arguments is allowed
            seen["end"] = summary["steps"]

    overrides = [*TINY_OVERRIDES, f"run.out_dir='{tmp_path}'", "run.name='hooks'", "run.max_steps=3"]
    config = load_config(None, overrides)
    manager = create_plugin_manager()
    manager.register(Recorder(), name="recorder")
    run_training(config, manager)
    assert seen["configure"] == 1 and seen["end"] == 3
    assert [s for s, _ in seen["steps"]] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in seen["steps"])


from conftest import TINY as TINY_OVERRIDES  # noqa: E402


def test_trainer_tells_the_precision_policy_fsdp_size_when_its_apply_takes_it(tmp_path):
    """A policy whose ``apply`` takes ``fsdp_size`` gets the parallelism's (1 in one process); one
    whose ``apply(model)`` takes only the model still works."""
    from gemcore.config import load_config
    from gemcore.precision import PrecisionPolicy
    from gemcore.trainer import Trainer

    seen = {}

    class Sized(PrecisionPolicy):
        def apply(self, model, *, fsdp_size=1):
            seen["sized"] = fsdp_size
            return model

    class Plain(PrecisionPolicy):
        def apply(self, model):
            seen["plain"] = True
            return model

    class Policies:
        @hookimpl
        def gemcore_precision_policies(self):
            return {"sized": lambda config: Sized(), "plain": lambda config: Plain()}

    for name in ("sized", "plain"):
        config = load_config(None, [*TINY_OVERRIDES, f"run.out_dir='{tmp_path}'", f"precision.impl='{name}'"])
        manager = create_plugin_manager([])
        manager.register(Policies(), name="policies")
        Trainer(config, manager, tmp_path / name)
    assert seen == {"sized": 1, "plain": True}
