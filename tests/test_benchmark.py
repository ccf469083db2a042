"""The throughput benchmark runs end to end on CPU with a tiny model, in its steps, packing and search
modes (no timing assertions)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_throughput_tiny_cpu(tmp_path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--device", "cpu", "--tiny",
                        "--methods", "supervised,cowmix", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "steps/s" in r.stdout and "speed-up" in r.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [row["method"] for row in rows] == ["supervised", "cowmix"]
    for row in rows:
        assert row["fast_steps_per_s"] > 0 and row["conventional_steps_per_s"] > 0
        assert row["gflop_per_step"] > 0
    assert rows[1]["gflop_per_step"] > rows[0]["gflop_per_step"]  # CowMix adds teacher and mixed passes


def test_search_mode_tiny_cpu(tmp_path):
    """The third mode runs the real search script (Ray Tune, Optuna, ASHA, embedded MLflow) and reads back
    what every trial did; on CPU with the smoke settings."""
    out = tmp_path / "search.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--device", "cpu", "--tiny",
                        "--search", "2", "--epochs", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "wall time" in r.stdout and "2 ran all 2 epochs" in r.stdout
    result = json.loads(out.read_text())
    assert result["wall_s"] > 0 and len(result["trials"]) == 2
    assert all(t["epochs"] == 2 and t["status"] == "FINISHED" and 0 <= t["val_error_teacher"] <= 1
               for t in result["trials"])
    # the timeline comes from MLflow's timestamps: two epoch reports per trial, in order, inside the wall time
    assert all(len(t["epoch_reports_s"]) == 2 and 0 < t["opened_s"] < t["epoch_reports_s"][0]
               < t["epoch_reports_s"][1] < result["wall_s"] for t in result["trials"])
    tl = result["timeline"]
    assert 0 < tl["first_trial_opened_s"] < tl["first_epoch_reported_s"] <= tl["last_epoch_reported_s"] < result["wall_s"]
    assert "timeline: first trial opened at" in r.stdout


def test_packing_mode_tiny_cpu(tmp_path):
    """The second mode runs k real trials at once under Ray Tune for each k (after a start barrier) and
    reports their rates."""
    out = tmp_path / "packing.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--device", "cpu", "--tiny",
                        "--packing", "1,2", "--steps", "4", "--epochs", "6", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["k"] for row in rows] == [1, 2] and [row["gpu_fraction"] for row in rows] == [1.0, 0.5]
    for row in rows:
        # report to report (evaluation and checkpoint included) takes longer than a trial's steps alone
        assert 0 < row["per_trial_steps_per_s"] < row["stepping_steps_per_s"]
        assert row["per_trial_steps_per_s"] == pytest.approx(row["aggregate_steps_per_s"] / row["k"])
    assert rows[0]["slowdown"] == pytest.approx(1.0)


def test_first_step_tiny_cpu(tmp_path):
    """The first-step benchmark runs each case in a fresh process: the cold one fills the compile caches,
    the warm one loads every graph from them, the student's training graph with its custom batch-norm
    function included (AOTAutograd would otherwise bypass its cache and trace it again)."""
    out = tmp_path / "first.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "first_step.py"), "--device", "cpu", "--tiny",
                        "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    cold, warm = json.loads(out.read_text())["rows"]
    assert (cold["run"], warm["run"]) == ("cold", "warm")
    graphs = cold["fx_graph_cache"]["fxgraph_cache_miss"]
    assert graphs >= 2 and "fxgraph_cache_hit" not in cold["fx_graph_cache"]   # student and teacher at least
    assert warm["fx_graph_cache"] == {"fxgraph_cache_hit": graphs}
    saved = cold["aot_autograd_cache"]["autograd_cache_saved"]
    assert saved >= 2 and "autograd_cache_bypass" not in cold["aot_autograd_cache"]   # student and teacher
    assert warm["aot_autograd_cache"] == {"autograd_cache_hit": saved}
    assert all(row["first_step_s"] > 0 and row["second_runner_first_step_s"] > 0 for row in (cold, warm))
    # the cached graphs compute what the freshly compiled ones did: same weights after the same first step
    assert warm["weights_after_first_step"] == pytest.approx(cold["weights_after_first_step"], rel=1e-6)


def test_conv_kernel_benchmark_tiny_cpu(tmp_path):
    """The convolution kernel benchmark's interpreter smoke run: every op and configuration on every tiny
    shape runs and agrees with PyTorch (the benchmark exits 1 on an error or a disagreement)."""
    pytest.importorskip("triton")
    out = tmp_path / "conv.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "conv_rows_bench.py"), "--device", "cpu",
                        "--tiny", "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert len(results) == 3
    assert all(set(row["ops"]) == {"fprop", "dgrad", "wgrad", "fprop_bn", "wgrad_bn"} for row in results[:2])
    assert set(results[2]["ops"]) == {"fprop", "wgrad"}   # a stem's, on 3 channels: no input gradient
    for row in results:
        for name, op in row["ops"].items():
            assert op["configs"], (row["shape"], name)
            for cfg in op["configs"]:
                assert "error" not in cfg and cfg["rel_err"] < 1e-4, (row["shape"], name, cfg)   # float32 here


def test_step_ab_tiny_cpu(tmp_path):
    """The step A/B script's smoke run: both settings build, step and report a rate."""
    out = tmp_path / "ab.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_ab.py"), "--device", "cpu", "--tiny",
                        "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["median"]) == {"cudnn", "triton"} and all(v > 0 for v in report["median"].values())


def test_step_ab_variants_switch_away_from_the_defaults(monkeypatch):
    """Each step_ab variant of ``FAST_SWITCHES`` sets fast-path switches away from their defaults (those on in the
    trainer off, an experiment's on): a default flipped without changing its variant would make the variant measure
    the defaults."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import step_ab

    from trainables.fast.switch import FastSwitches

    defaults = FastSwitches()
    for variant, switches in step_ab.FAST_SWITCHES.items():
        assert variant in step_ab.VARIANTS and switches, variant
        for name, value in switches.items():
            assert value != getattr(defaults, name), (variant, name)
    # the fast shake-shake blocks' switches, on by default: each variant turns one off
    from trainables.fast.model_swaps import ShakeShakeSwitches

    defaults = ShakeShakeSwitches()
    for variant, switches in step_ab.BLOCK_SWITCHES.items():
        assert variant in step_ab.VARIANTS and all(getattr(defaults, k) and v is False for k, v in switches.items())
    assert step_ab.BLOCK_SWITCHES["unstored-input-grads"] == {"store_input_grad": False}


def test_step_ab_builds_each_variants_runner_with_its_switches(tmp_path, monkeypatch):
    """Each variant's runner is built with its own fast-path switches (``variant_switches``: ``FAST_SWITCHES``' entry,
    an experiment's as one adds itself, or the defaults), passed to ``build_runner``: nothing is set on a class, so
    the defaults' runner built after a variant's has the defaults."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.chdir(tmp_path)
    import step_ab

    from trainables.fast.switch import FastSwitches

    _add_experiment(monkeypatch, step_ab, "experiment", {"teacher_stream": False})
    seen: list[FastSwitches] = []
    build = step_ab.build_runner

    def recording_build(*args, **kwargs):
        runner = build(*args, **kwargs)
        seen.append(runner.fast.switches)
        return runner

    monkeypatch.setattr(step_ab, "build_runner", recording_build)
    variants = "eager-ema,one-update,no-priority,narrow-rows,experiment,wgrad-stream"
    assert step_ab.main(["--device", "cpu", "--tiny", "--variants", variants]) == 0
    assert seen == [FastSwitches(compile_ema=False), FastSwitches(update_in_parts=False),
                    FastSwitches(capture_priority=False), FastSwitches(same_and_biased=False),
                    FastSwitches(teacher_stream=False), FastSwitches()]
    assert set(step_ab.FAST_SWITCHES) == set(variants.split(",")[:-1])   # each of the table's variants was built
    assert step_ab.variant_switches("inductor:aggressive_fusion=True") == \
        FastSwitches(extra_inductor_options={"aggressive_fusion": True})
    assert step_ab.variant_switches(None) == step_ab.variant_switches("cudnn") == FastSwitches()


def test_step_ab_refuses_a_shake_shake_switch_for_another_model(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import step_ab

    monkeypatch.setattr(step_ab, "VARIANTS", (*step_ab.VARIANTS, "shake-experiment"))
    monkeypatch.setitem(step_ab.BLOCK_SWITCHES, "shake-experiment", {"one_first_conv": False})
    with pytest.raises(SystemExit):
        step_ab.main(["--device", "cpu", "--tiny", "--variants", "wgrad-stream,shake-experiment"])
    assert "shake-experiment: switches of the shake-shake models, not of cnn_tiny" in capsys.readouterr().err


NO_GPU_ONLY = pytest.mark.skipif(__import__("torch").cuda.is_available(),
                                 reason="asks what a machine without a GPU says")


def _refused_before_any_data(monkeypatch, capsys, argv) -> str:
    """What throughput.py says to ``argv`` when it refuses it, having made no images."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import throughput

    loaded = []
    monkeypatch.setattr(throughput, "load_images", lambda *a, **k: loaded.append(a))
    with pytest.raises(SystemExit) as e:
        throughput.main(argv)
    assert loaded == []
    return (e.value.code if isinstance(e.value.code, str) else "") + capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--device", "gpu"], "--device gpu: not a device"),
    (["--device", "cpu", "--models", "wrn28"], "unknown model 'wrn28'; known: "),
    (["--device", "cpu", "--methods", "cowmixx"], "unknown method 'cowmixx'; known: "),
])
def test_throughput_refuses_bad_input_before_any_data_is_made(monkeypatch, capsys, argv, says):
    """One message naming what is wrong, before the benchmark makes its images or builds a model."""
    assert says in _refused_before_any_data(monkeypatch, capsys, argv)


@NO_GPU_ONLY
@pytest.mark.parametrize("argv, says", [
    ([], "no CUDA GPU here, and the table times the GPU training step: --device cpu --tiny"),
    (["--device", "cuda"], "throughput.py: needs a CUDA GPU, and torch sees none here; --device cpu --tiny"),
])
def test_throughput_without_a_gpu_says_what_runs_on_a_cpu(monkeypatch, capsys, argv, says):
    assert says in _refused_before_any_data(monkeypatch, capsys, argv)


@NO_GPU_ONLY
@pytest.mark.parametrize("script", ["gpu_checks.py", "profile_step.py", "kernel_breakdown.py", "step_ab.py",
                                    "runner_memory.py", "first_step.py", "conv_rows_bench.py", "bn_relu_pair_bench.py"])
def test_gpu_only_benchmarks_say_so_on_a_machine_without_a_gpu(script):
    """Each GPU-only script (or mode: the default device of step_ab, first_step and conv_rows_bench is the GPU) exits
    with one line naming itself and the missing GPU, not a CUDA traceback."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1].startswith(f"{script}: needs a CUDA GPU, and torch sees none here"), \
        r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_gpu_checks_names_an_unknown_check_before_anything_runs():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_checks.py"), "losses", "no_such_check"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "gpu_checks.py: unknown check 'no_such_check'; known: losses, losses_cudnn,"), r.stderr[-2000:]


def test_step_ab_compiles_an_inductor_variant_with_its_options(monkeypatch, capsys):
    """An ``inductor:KEY=VALUE`` variant's options reach torch.compile for its runner's student and teacher, over the
    trainer's own (here the threshold the config asks for), and its compile key; after it, runners are built without
    them. A name or a type torch.compile would refuse is refused before any runner is built, and so is --tiny, which
    does not compile."""
    import torch
    import torch._inductor.config as inductor

    from trainables.config import TrainConfig
    from trainables.data import Batch
    from trainables.fast.switch import FastSwitches, compile_key
    from trainables.trainer import build_runner

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import step_ab

    assert step_ab.inductor_options_of("inductor:aggressive_fusion=True;triton.multi_kernel=1") == \
        {"aggressive_fusion": True, "triton.multi_kernel": 1}
    assert step_ab.inductor_options_of("wgrad-stream") == {}
    for bad, says in (("inductor:no_such_option=1", "'no_such_option' is not an option"),
                      ("inductor:os=1", "'os' is not an option"),   # a module attribute, not an option
                      ("inductor:aggressive_fusion", "is not KEY=VALUE"),
                      ("inductor:aggressive_fusion=maybe", "'maybe' is not a Python literal"),
                      ("inductor:aggressive_fusion=1", "aggressive_fusion, got int should be bool"),
                      ("inductor:aggressive_fusion=True", "variants compile the step with their options, and --tiny")):
        built = []
        monkeypatch.setattr(step_ab, "build_runner", lambda *a, **k: built.append(a))
        with pytest.raises(SystemExit):
            step_ab.main(["--device", "cpu", "--tiny", "--variants", f"wgrad-stream,{bad}"])
        assert says in capsys.readouterr().err and built == []

    compiled = []   # the options each torch.compile call of a model got, as it got them
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compiled.append(dict(kw.get("options") or {}))
                        or compile_(model, **kw))
    cfg = TrainConfig.from_dict({"model": "cnn_tiny", "train": {"compile": True, "realize_reads_threshold": 3}})
    x = torch.zeros(2, 3, 32, 32)
    batch = Batch(x, torch.zeros(2, dtype=torch.long), x, x)
    models = []   # per runner: the options of its models' compiles (those with a threshold; the glue has none)
    with inductor.patch(realize_reads_threshold=inductor.realize_reads_threshold), \
            torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit):
        for extra in ({}, {"aggressive_fusion": True, "realize_reads_threshold": 5}, {}):
            compiled.clear()
            runner = build_runner(cfg, 10, torch.device("cpu"), switches=FastSwitches(extra_inductor_options=extra))
            models.append(([o for o in compiled if "realize_reads_threshold" in o], compile_key(runner, batch)))
    (plain, plain_key), (varied, varied_key), (after, after_key) = models
    assert len(plain) == len(varied) == 2   # student and teacher
    assert all(o["aggressive_fusion"] is True and o["realize_reads_threshold"] == 5 for o in varied)
    assert all("aggressive_fusion" not in o and o["realize_reads_threshold"] == 3 for o in plain)
    assert after == plain and varied_key != plain_key == after_key


def _add_experiment(monkeypatch, step_ab, name, switches):
    """``name`` a step_ab variant that sets ``switches`` (``FastSwitches`` fields), as an experiment adds itself."""
    monkeypatch.setattr(step_ab, "VARIANTS", (*step_ab.VARIANTS, name))
    monkeypatch.setitem(step_ab.FAST_SWITCHES, name, switches)


def test_gpu_checks_losses_of_a_variant_give_its_switches_to_the_fast_runner(monkeypatch):
    """The losses check of a step_ab variant (an experiment's, as one adds itself) passes the variant's fast-path
    switches for the fast runner, which alone is built with them."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_checks
    import step_ab

    from trainables.fast.switch import FastSwitches

    _add_experiment(monkeypatch, step_ab, "experiment", {"teacher_stream": False})
    seen = []
    monkeypatch.setattr(gpu_checks, "check_losses", lambda **kw: seen.append(kw) or 1)
    assert gpu_checks.check_losses_switched("experiment", model="wrn26_6_shakeshake") == 1
    assert seen == [{"switches": FastSwitches(teacher_stream=False), "model": "wrn26_6_shakeshake"}]


def test_kernel_bytes_joins_a_trace_with_inductors_byte_counts(tmp_path, monkeypatch):
    """Each kernel's bytes a launch come from its module's inductor_meta, its time and launches from the trace:
    0.3 GB twice a step in 200 us is 3 TB/s; a name two modules size differently gets no bandwidth."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import kernel_bytes as kb

    def module(args: str, *kernels: tuple[str, float]) -> str:
        return f"def call(args):\n    {args}\n" + "".join(
            f"{name} = async_compile.triton('{name}', '''\n@triton_heuristics.pointwise(\n    inductor_meta="
            f"{{'grid_type': 'Grid1D', 'kernel_name': '{name}', 'num_load': 2, 'kernel_num_gb': {gb}, "
            f"'kernel_flop': 0}},\n)\n''')\n" for name, gb in kernels)

    (tmp_path / "code" / "ab").mkdir(parents=True)
    (tmp_path / "code" / "ab" / "cbwd.py").write_text(module("primals_1, tangents_1 = args",
                                                             ("triton_poi_a_0", 0.3), ("triton_poi_same_1", 0.1)))
    (tmp_path / "code" / "ab" / "cfwd.py").write_text(module("primals_1, primals_2 = args", ("triton_poi_same_1", 0.2)))
    # the cache's file of one kernel: its source, and a call() that benchmarks it
    kernel_alone = module("", ("triton_poi_a_0", 0.3)).split("'''", 1)[1].split("'''")[0]
    (tmp_path / "code" / "ab" / "ckernel.py").write_text(kernel_alone + "def call(args):\n    pass\n")
    steps = 2
    events = [{"cat": "kernel", "name": "triton_poi_a_0", "dur": 100.0}] * (2 * steps) + \
             [{"cat": "kernel", "name": "triton_poi_same_1", "dur": 50.0}] * steps + \
             [{"cat": "kernel", "name": "sm90_xmma_fprop", "dur": 500.0}, {"cat": "cpu_op", "name": "triton_x"}]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    rows = {r.name: r for r in kb.rows(kb.load_trace(trace), kb.kernel_bytes([tmp_path / "code"]), steps)}
    assert set(rows) == {"triton_poi_a_0", "triton_poi_same_1"}   # Triton kernels only
    a = rows["triton_poi_a_0"]
    assert (a.kind, a.us, a.launches, a.gb) == ("backward", 200.0, 2.0, 0.3)
    assert a.tb_per_s == pytest.approx(3.0)
    same = rows["triton_poi_same_1"]
    assert same.kind == "?" and same.gb is None and same.tb_per_s is None
    totals = kb.summary(list(rows.values()), bandwidth=3.0)
    assert totals["backward"] == pytest.approx((200.0, 0.6, 200.0)) and totals["?"] == (50.0, 0.0, 0.0)
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_bytes.py"), str(trace),
                        str(tmp_path / "code"), "--steps", str(steps)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "3.00 TB/s  triton_poi_a_0" in r.stdout, r.stdout + r.stderr
    (tmp_path / "plain").mkdir()   # a cache compiled without TORCHINDUCTOR_BENCHMARK_KERNEL=1
    (tmp_path / "plain" / "c.py").write_text("triton_poi_a_0 = async_compile.triton('triton_poi_a_0', '')\n")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_bytes.py"), str(trace),
                        str(tmp_path / "plain")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "TORCHINDUCTOR_BENCHMARK_KERNEL=1" in r.stderr


def test_profile_step_imports_and_parses_its_arguments():
    """profile_step.py needs a GPU to run but still imports here (its helpers from the other scripts) and lists its
    options: step_ab's switched variants and Inductor's threshold."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_step.py"), "--help"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "unstored-input-grads" in r.stdout and "--reads N" in r.stdout


def test_bn_relu_pair_bench_checks_its_kernels_in_the_interpreter():
    """The paired batch norms' benchmark on CPU: its kernels in Triton's interpreter against the formula, no timing."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bn_relu_pair_bench.py"), "--device", "cpu",
                        "--tiny"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count(" OK") == 2 and "WRONG" not in r.stdout, r.stdout


def test_profile_step_refuses_a_threshold_below_one_before_asking_for_a_gpu():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_step.py"), "--reads", "0"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith("--reads: Inductor's realize_reads_threshold must be >= 1, got 0")
