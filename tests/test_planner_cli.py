"""``gem plan``: JSON shape, --degrees evaluation and explanations, exit codes."""
import json

import pytest

from gemcore.cli.main import main

KEYS = {"dp_replicate", "dp_shard", "tp", "cp", "ep", "pp", "memory_gb", "step_time_s",
        "tokens_per_s_per_gpu", "mfu", "mbs", "ac", "schedule", "memory_breakdown_gb", "compute_s",
        "exposed_comm_s", "intra_node", "inter_node"}


def run_json(capsys, *argv):
    code = main(["plan", *argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else None


def test_search_json_shape(capsys):
    code, out = run_json(capsys, "--model", "llama3-8b", "--gpus", "16", "--gpus-per-node", "8",
                         "--gpu", "h100", "--top", "3", "--global-batch", "32")
    assert code == 0 and 1 <= len(out["plans"]) <= 3
    for plan in out["plans"]:
        assert KEYS <= set(plan)
        degrees = plan["dp_replicate"] * plan["dp_shard"] * plan["cp"] * plan["tp"] * plan["pp"]
        assert degrees == 16
        assert set(plan["memory_breakdown_gb"]) == {"parameters", "gradients", "optimizer", "activations"}
        assert 0 < plan["mfu"] < 1 and plan["memory_gb"] <= plan["memory_limit_gb"]
    assert out["why"][0].startswith("best:")


def test_degrees_evaluates_one_plan(capsys):
    code, out = run_json(capsys, "--model", "llama3-70b", "--gpus", "64", "--gpu", "h100",
                         "--degrees", "dp_shard=8,tp=8,ac=full", "--global-batch", "64")
    assert code == 0 and len(out["plans"]) == 1
    plan = out["plans"][0]
    assert (plan["dp_shard"], plan["tp"], plan["ac"]) == (8, 8, "full")
    assert plan["intra_node"] == ["tp"] and plan["inter_node"] == ["dp_shard"]


@pytest.mark.parametrize("degrees, words", [
    ("dp_shard=4,tp=3", ["tp=3 must divide the heads", "= 12 GPUs, but the cluster has 16"]),
    ("dp_shard=2,tp=8,ac=none,mbs=1", ["GB per GPU", "more than the"]),
])
def test_degrees_infeasible_explains_and_exits_2(capsys, degrees, words):
    code, out = run_json(capsys, "--model", "llama3-70b", "--gpus", "16", "--degrees", degrees,
                         "--global-batch", "16")
    assert code == 2 and out["plans"] == []
    text = " ".join(out["infeasible"])
    for w in words:
        assert w in text


def test_model_that_cannot_fit_exits_2(capsys):
    code = main(["plan", "--model", "llama3-405b", "--gpus", "8", "--global-batch", "8"])
    err = capsys.readouterr().err
    assert code == 2 and "no feasible plan" in err and "least memory-hungry layout" in err


@pytest.mark.parametrize("argv, word", [
    (["--model", "nope", "--gpus", "8"], "--model"),
    (["--model", "llama3-8b"], "--gpus"),
    (["--model", "llama3-8b", "--gpus", "12", "--gpus-per-node", "8"], "--gpus"),
    (["--model", "llama3-8b", "--gpus", "8", "--degrees", "tp=x"], "--degrees"),
    (["--model", "llama3-8b", "--gpus", "8", "--seq-len", "0"], "--seq-len"),
])
def test_bad_input_exits_2_naming_the_argument(capsys, argv, word):
    assert main(["plan", *argv]) == 2
    assert word in capsys.readouterr().err


def test_bad_sac_policy_and_kernel_stack_exit_2(capsys, tmp_path):
    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8"]
    assert main([*base, "--degrees", "dp_shard=8,ac=selective,sac=odd_mm"]) == 2
    assert "sac must be one of all_mm, every_other_mm" in capsys.readouterr().err
    assert main(["plan", "--model", "deepseek-v3", "--gpus", "8", "--global-batch", "8",
                 "--degrees", "dp_shard=8,ep=8,ac=selective,sac=every_other_mm"]) == 2
    assert "sac=every_other_mm is modelled for dense" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main([*base, "--kernels", "compiled"])
    assert exc.value.code == 2 and "--kernels" in capsys.readouterr().err
    f = tmp_path / "c.toml"
    f.write_text('[cluster]\ngpu = "h100"\ngpus = 8\nkernels = "compile"\n')
    assert main(["plan", "--model", "llama3-8b", "--cluster", str(f), "--global-batch", "8",
                 "--degrees", "dp_shard=8"]) == 2
    assert "--kernels must be one of fused, eager, compiled-blocks, eager-torch-rmsnorm" in capsys.readouterr().err


def test_torchtitan_policy_and_compiled_blocks(capsys):
    argv = ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "8",
            "--degrees", "dp_shard=8,ac=selective"]
    _, gemcore = run_json(capsys, *argv, "--kernels", "compiled-blocks")
    _, titan = run_json(capsys, *argv[:-1], argv[-1] + ",sac=every_other_mm", "--kernels", "compiled-blocks")
    a, b = gemcore["plans"][0], titan["plans"][0]
    assert (a["sac"], b["sac"]) == ("all_mm", "every_other_mm")
    assert b["memory_breakdown_gb"]["activations"] < a["memory_breakdown_gb"]["activations"]
    assert b["tokens_per_s_per_gpu"] < a["tokens_per_s_per_gpu"]
    assert main(["plan", *argv[:-1], argv[-1] + ",sac=every_other_mm"]) == 0
    assert "selective (sac=every_other_mm)" in capsys.readouterr().out


def test_text_output_and_model_file(capsys, tmp_path):
    f = tmp_path / "gem.toml"
    f.write_text('[model]\nbase = "gem-small"\nnum_layers = 4\n')
    assert main(["plan", "--model", str(f), "--gpus", "8", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "tok/s/GPU" in out and "best:" in out


def test_cluster_file_tiers(capsys, tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[cluster]\ngpu = "a100"\ngpus = 32\ngpus_per_node = 8\n'
                 '[[cluster.tiers]]\nname = "rack"\ngpus = 16\noversubscription = 1.0\n'
                 '[[cluster.tiers]]\nname = "spine"\ngpus = 32\noversubscription = 4.0\n')
    code, flat = run_json(capsys, "--model", "llama3-8b", "--gpus", "32", "--gpu", "a100",
                          "--degrees", "dp_shard=32", "--global-batch", "32")
    code2, tiered = run_json(capsys, "--model", "llama3-8b", "--cluster", str(f), "--degrees", "dp_shard=32",
                             "--global-batch", "32")
    assert code == code2 == 0 and tiered["gpu"] == "a100"
    assert tiered["plans"][0]["step_time_s"] > flat["plans"][0]["step_time_s"]


def test_a_gpu_bound_step_reports_no_host_time(capsys):
    """With the datasheet's zero host overheads a GPU-bound step has exactly none: the phase-by-phase
    host/GPU play must not leave rounding residue (it had printed "host overhead -8.88e-16 s")."""
    assert main(["plan", "--model", "llama3-70b", "--gpus", "64", "--gpus-per-node", "8", "--gpu", "h100",
                 "--top", "5", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert len(plans) == 5 and all(p["host_overhead_s"] == 0.0 for p in plans)
    assert main(["plan", "--model", "llama3-70b", "--gpus", "64", "--gpus-per-node", "8", "--gpu", "h100",
                 "--top", "1"]) == 0
    assert "host overhead" not in capsys.readouterr().out


def test_degrees_search_the_knobs_not_given(capsys):
    """Llama 3 405B at Meta's published degrees (arXiv 2407.21783, Table 4: 400 TFLOP/s per GPU on
    16,384 H100): with only the degrees, the planner searches virtual stages, recompute and
    resharding and lands within 20 %; knobs that are given are kept."""
    argv = ["--model", "llama3-405b", "--gpus", "16384", "--gpus-per-node", "8", "--gpu", "h100",
            "--seq-len", "8192", "--global-batch", "2048"]
    code, out = run_json(capsys, *argv, "--degrees", "tp=8,pp=16,dp_shard=128")
    assert code == 0 and {"virtual_stages", "ac", "kernels"} <= set(out["searched"])
    best = out["plans"][0]
    assert abs(best["mfu"] * 989 / 400 - 1) < 0.2
    assert best["virtual_stages"] > 1
    code, fixed = run_json(capsys, *argv, "--degrees", "tp=8,pp=16,dp_shard=64,dp_replicate=2,ac=full,v=1")
    plan = (fixed["plans"] or [fixed.get("estimate")])[0]
    assert (plan["ac"], plan["virtual_stages"], plan["schedule"]) == ("full", 1, "1F1B")
    assert "ac" not in fixed["searched"] and "virtual_stages" not in fixed["searched"]


def test_default_global_batch_is_4m_tokens_for_llms(capsys):
    code, out = run_json(capsys, "--model", "llama3-405b", "--gpus", "16384", "--seq-len", "8192",
                         "--degrees", "tp=8,pp=16,dp_shard=128")
    assert out["global_batch"] == 4 * 2**20 // 8192 == 512
    code, out = run_json(capsys, "--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192",
                         "--degrees", "dp_shard=8")
    assert out["global_batch"] == 8     # one sequence per GPU is below the cap


def test_help_states_the_default_global_batch(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "4M tokens" in " ".join(capsys.readouterr().out.split())


def test_validate_prints_every_published_run(capsys):
    from gemcore.planner.validation import RUNS, predict

    assert main(["plan", "--validate"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + len(RUNS)
    for run, line in zip(RUNS, lines[1:]):
        assert line.startswith(run.name)
        got = predict(run)
        assert ("does not fit" in line) == (not got.fits)
        if got.fits:
            assert f"{got.predicted:,.0f} ({got.error:+4.0%})" in line
    meta = predict(next(r for r in RUNS if r.name == "Meta 405B, 16,384 H100"))
    assert meta.fits and abs(meta.error) < 0.2


def test_validate_marks_a_layout_that_does_not_fit():
    from dataclasses import replace

    from gemcore.planner.validation import RUNS, predict, table

    too_big = replace(RUNS[0], name="405B on 64 GPUs", gpus=64, degrees="tp=8,pp=8",
                      global_batch=16)
    assert not predict(too_big).fits
    assert "does not fit" in table([too_big])[1] and "GB allowed" in table([too_big])[1]
