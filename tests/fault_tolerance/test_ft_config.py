"""Options, precedence and the timeout-chain check (no processes)."""

import pytest

from trainguard.fault_tolerance import FaultToleranceConfig, LaunchConfigError, check_timeout_chain
from trainguard.fault_tolerance._args import parse_launch_args
from trainguard.fault_tolerance.config import load_yaml_section


def test_defaults_then_yaml_then_cli(tmp_path, monkeypatch):
    cfg_file = tmp_path / "job.yaml"
    cfg_file.write_text("model: {a: 1}\nextra:\n  fault_tolerance:\n"
                        "    rank_heartbeat_timeout: 40\n"
                        "    rank_section_timeouts: {step: 30, ckpt: null}\n"
                        "    safety_factor: 3\n")
    script = tmp_path / "s.py"
    script.write_text("")
    spec = parse_launch_args(["--ft-cfg-path", str(cfg_file), "--ft-safety-factor", "7",
                              str(script), "--ft-safety-factor", "99"])
    ft = spec.ft
    assert ft.rank_heartbeat_timeout == 40.0  # YAML over the default (600)
    assert ft.safety_factor == 7.0  # CLI over YAML; the script's identical flag is not ours
    assert dict(ft.rank_section_timeouts) == {"step": 30.0}  # null disables a section
    assert ft.initial_rank_heartbeat_timeout == 900.0  # default
    assert spec.script_args == ("--ft-safety-factor", "99")
    assert ft.client_timeouts_explicit()
    assert not FaultToleranceConfig().client_timeouts_explicit()


def test_pet_environment_sits_between_cli_and_defaults(tmp_path, monkeypatch):
    script = tmp_path / "s.py"
    script.write_text("")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_MAX_RESTARTS", "4")
    spec = parse_launch_args([str(script)])
    assert (spec.nproc_per_node, spec.max_restarts) == (3, 4)
    spec = parse_launch_args(["--nproc_per_node", "2", str(script)])
    assert (spec.nproc_per_node, spec.max_restarts) == (2, 4)
    monkeypatch.setenv("PET_STANDALONE", "1")
    assert parse_launch_args([str(script)]).max_restarts == 4


@pytest.mark.parametrize("argv,needle", [
    (["--ft-rank-heartbeat-timeout", "0", "s.py"], "positive number of seconds"),
    (["--ft-rank-section-timeouts", "step", "s.py"], "must look like 'step:30"),
    (["--ft-rank-termination-signal", "SIGNOPE", "s.py"], "unknown signal"),
    (["--ft-no-restart-exit-code", "300", "s.py"], "1..255"),
    (["--nnodes", "2", "s.py"], "needs --rdzv-endpoint"),
    (["--nproc-per-node", "0", "s.py"], "must be >= 1"),
    (["--max-restarts", "x", "s.py"], "not a valid int"),
    ([], "no training script"),
    (["--master-port", "99999", "s.py"], "a TCP port is 0-65535"),
    (["--master-port", "-5", "s.py"], "a TCP port is 0-65535"),
    (["--log-dir", "/proc/nope", "s.py"], "--log-dir '/proc/nope': cannot create or write it"),
    (["--log-dir", "s.py/logs", "s.py"], "cannot create or write it"),  # under a file
    (["--log-dir", "s.py", "s.py"], r"it is a file, not a directory"),
    # a bad path is a bad input (exit 2), not an unhealthy node (exit 95, found by a new user)
    (["--ft-checkpoint-iteration-file", "s.py/it.txt", "s.py"],
     r"--ft-checkpoint-iteration-file: directory '.*s.py': cannot create or write it \(it is"),
    (["--ft-checkpoint-iteration-file", ".", "s.py"], "is a directory; name a file in it"),
])
def test_bad_input_is_one_clear_error(tmp_path, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.py").write_text("")
    with pytest.raises(LaunchConfigError, match=needle):
        parse_launch_args(argv)


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("fault_tolerance:\n  safety_factor: 3\n   pg_timeout: 30\n")
    with pytest.raises(LaunchConfigError) as err:
        load_yaml_section(str(bad))
    msg = str(err.value)  # one line: file, line and column, what to fix
    assert "\n" not in msg and f"{bad}:3:" in msg and "invalid YAML" in msg, msg
    assert "fix the syntax" in msg
    unknown = tmp_path / "u.yaml"
    unknown.write_text("fault_tolerance: {heartbeat: 3}\n")
    with pytest.raises(LaunchConfigError, match="unknown fault_tolerance option 'heartbeat'"):
        FaultToleranceConfig.merged(load_yaml_section(str(unknown)), {})


@pytest.mark.parametrize("text,needle", [
    ("fault_tolerence:\n  rank_heartbeat_timeout: 5\n", "top-level keys: fault_tolerence"),
    ("", "empty or not a mapping"),
    ("- a\n- b\n", "empty or not a mapping"),
])
def test_a_file_without_the_section_is_refused_not_ignored(tmp_path, text, needle):
    """New-user finding: a misspelt section ran the job on defaults, exit 0, no warning."""
    cfg = tmp_path / "ft.yaml"
    cfg.write_text(text)
    with pytest.raises(LaunchConfigError) as err:
        load_yaml_section(str(cfg))
    msg = str(err.value)
    assert "\n" not in msg and str(cfg) in msg and needle in msg, msg
    assert "no 'fault_tolerance:' section" in msg, msg
    nested = tmp_path / "nested.yaml"  # NVRx-style nesting and an empty section still work
    nested.write_text("trainer:\n  fault_tolerance:\n    safety_factor: 3\n")
    assert load_yaml_section(str(nested)) == {"safety_factor": 3}
    nested.write_text("fault_tolerance:\n")
    assert load_yaml_section(str(nested)) == {}


@pytest.mark.parametrize("values,expected", [
    ({}, []),
    ({"rank_heartbeat_timeout": 120, "pg_timeout": 30, "auto_heartbeat_timeout": None},
     [("rank_heartbeat_timeout (120 s) >= "
      "process-group timeout (30 s)")]),
    ({"initial_rank_heartbeat_timeout": 10, "rank_heartbeat_timeout": 60},
     ["initial_rank_heartbeat_timeout (10 s) < rank_heartbeat_timeout (60 s)"]),
    ({"rank_section_timeouts": "step:0.1", "workload_check_interval": 0.1},
     ["rank_section_timeouts[step] (0.1 s) < 2 x workload_check_interval"]),
    ({"rank_heartbeat_timeout": None, "auto_heartbeat_timeout": None},
     ["no hang timeout is active"]),
])
def test_timeout_chain_prints_one_line_per_violation(values, expected):
    lines = check_timeout_chain(FaultToleranceConfig.merged(values, {}))
    assert len(lines) == len(expected), lines
    for line, prefix in zip(lines, expected):
        assert line.startswith(prefix), line
        assert ";" in line  # every line carries its fix


def test_rendezvous_timeout_must_cover_a_restart():
    lines = check_timeout_chain(FaultToleranceConfig(), rdzv_timeout_s=10)
    assert lines == [lines[0]] and "rendezvous timeout (10 s) <= workers_stop_timeout" in lines[0]


def test_help_shows_only_real_defaults():
    from trainguard.fault_tolerance._args import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "(default )" not in text and "(default none)" not in text
    assert "(default: 1:1)" in text  # --nnodes keeps its default
    assert "tg<launcher pid>" in text  # --rdzv-id says what it falls back to


def test_a_missing_module_is_one_error_without_running_user_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LaunchConfigError, match="-m 'no.such.module': no module named 'no'"):
        parse_launch_args(["-m", "no.such.module"])
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("open('imported', 'w').close()\n")
    assert parse_launch_args(["-m", "mypkg.train"]).module  # found in the cwd, not imported
    assert parse_launch_args(["-m", "json.tool"]).script == "json.tool"
    assert not (tmp_path / "imported").exists()


def test_only_error_lines_follow_a_signal_death():
    from trainguard.fault_tolerance._cycle import is_error_line

    for line in ["Traceback (most recent call last):", "RuntimeError: CUDA error: out of memory",
                 "torch.distributed.DistBackendError: NCCL error", "Fatal Python error: Aborted",
                 "terminate called after throwing an instance of 'c10::Error'"]:
        assert is_error_line(line), line
    for line in ["/x/_pytree.py:21: `isinstance(treespec, LeafSpec)` i", "train()", "",
                 "UserWarning: the Error handler is deprecated", "step 40 loss 1.2"]:
        assert not is_error_line(line), line
