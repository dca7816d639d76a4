"""dev/demo.sh as a newcomer meets it: bad arguments answer at once with one line each, before any set-up,
and a failed run leaves nothing behind in the cache or in the ComfyUI checkout. No server, no set-up: a
stand-in ComfyUI whose main.py exits at once makes the run fail where a broken ComfyUI would."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "dev"))
import comfy_server  # noqa: E402
import demo  # noqa: E402


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty $SDACCEL_HOME, so nothing here reads or writes the real cache."""
    path = tmp_path / "home"
    path.mkdir()
    monkeypatch.setenv("SDACCEL_HOME", str(path))
    monkeypatch.delenv("SDACCEL_COMFYUI", raising=False)
    return path


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "mine" / "my_model.safetensors"
    path.parent.mkdir()
    path.write_bytes(b"not really a model")
    return path


@pytest.fixture
def broken_comfyui(tmp_path):
    """A checkout with ComfyUI's layout whose main.py exits with an error, as a broken install does."""
    path = tmp_path / "ComfyUI"
    (path / "comfy").mkdir(parents=True)
    (path / "custom_nodes").mkdir()
    (path / "main.py").write_text("import sys\nsys.exit('this ComfyUI cannot start')\n")
    return path


def _error_line(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        demo.parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("argv, words", [
    (["--ckpt", "/nonexistent.safetensors"], "argument --ckpt: no such file: /nonexistent.safetensors"),
    (["--comfyui", "/nonexistent-dir"], "argument --comfyui: no such folder: /nonexistent-dir"),
    (["--size", "0"], "argument --size: 0 is out of range (64 to 2048)"),
    (["--size", "100"], "argument --size: 100 is not a multiple of 8"),
    (["--size", "big"], "argument --size: not an integer: 'big'"),
    (["--steps", "0"], "argument --steps: 0 is out of range (1 to 200)"),
    (["--seed", "-1"], "argument --seed: -1 is out of range"),
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
], ids=["ckpt-missing", "comfyui-missing", "size-0", "size-not-x8", "size-text", "steps-0", "seed-negative",
        "preset"])
def test_a_bad_argument_is_one_line_naming_it(capsys, home, argv, words):
    line = _error_line(capsys, argv)
    assert line.startswith("dev/demo.sh: " + words), line
    assert line.endswith("see --help")


def test_a_checkpoint_must_be_a_readable_safetensors_or_ckpt_file(capsys, home, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert "is not a checkpoint (want .safetensors or .ckpt)" in _error_line(capsys, ["--ckpt", str(text)])
    assert "not a file: %s" % tmp_path in _error_line(capsys, ["--ckpt", str(tmp_path)])
    for name in ("a.safetensors", "b.CKPT"):
        path = tmp_path / name
        path.write_bytes(b"x")
        assert demo.parse_args(["--ckpt", str(path)]).ckpt == str(path)


def test_comfyui_must_be_a_checkout_with_main_py_and_its_comfy_package(capsys, home, tmp_path, broken_comfyui):
    assert "%s is not a ComfyUI checkout (no main.py in it)" % tmp_path in _error_line(
        capsys, ["--comfyui", str(tmp_path)])
    (broken_comfyui / "comfy").rmdir()
    assert "(no comfy in it)" in _error_line(capsys, ["--comfyui", str(broken_comfyui)])


def test_the_comfyui_of_the_environment_is_checked_under_its_own_name(capsys, home, monkeypatch, broken_comfyui):
    monkeypatch.setenv("SDACCEL_COMFYUI", "/nonexistent-dir")
    assert _error_line(capsys, []).startswith("dev/demo.sh: SDACCEL_COMFYUI: no such folder: /nonexistent-dir")
    monkeypatch.setenv("SDACCEL_COMFYUI", str(broken_comfyui))
    assert demo.parse_args([]).comfyui == str(broken_comfyui)


def test_preset_with_your_own_checkpoint_is_refused(capsys, home, ckpt):
    line = _error_line(capsys, ["--ckpt", str(ckpt), "--preset", "tiny"])
    assert "--preset sizes the random checkpoint" in line


def test_relative_paths_are_the_users_and_become_absolute(home, ckpt, broken_comfyui, monkeypatch):
    monkeypatch.chdir(ckpt.parent.parent)
    a = demo.parse_args(["--ckpt", "mine/my_model.safetensors", "--comfyui", "ComfyUI", "--size", "128",
                         "--steps", "3", "--seed", "7"])
    assert (a.ckpt, a.comfyui) == (str(ckpt), str(broken_comfyui))
    assert (a.size, a.steps, a.seed, a.preset) == (128, 3, 7, None)


def _demo_sh(home, *args):
    """dev/demo.sh as a user runs it, with this interpreter as the system Python."""
    env = dict(os.environ, SDACCEL_HOME=str(home), PYTHON=sys.executable)
    env.pop("SDACCEL_COMFYUI", None)
    return subprocess.run(["bash", os.path.join(REPO, "dev", "demo.sh")] + list(args), env=env,
                          capture_output=True, text=True, timeout=60)


def test_help_and_a_bad_argument_answer_before_any_set_up(home):
    """On an empty cache the set-up would create a venv: both must answer without it."""
    shown = _demo_sh(home, "--help")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: dev/demo.sh") and "--ckpt FILE" in shown.stdout
    bad = _demo_sh(home, "--ckpt", "/nonexistent.safetensors")
    assert bad.returncode == 2
    assert bad.stderr == ("dev/demo.sh: argument --ckpt: no such file: /nonexistent.safetensors; "
                          "see --help\n")
    assert "[setup]" not in shown.stderr + bad.stderr
    assert os.listdir(home) == []


def _left_behind(home, comfy_dir):
    ckpts = home / "models" / "checkpoints"
    return (sorted(os.listdir(ckpts)) if ckpts.exists() else [],
            sorted(os.listdir(comfy_dir / "custom_nodes")))


def test_a_failed_run_leaves_no_link_and_the_same_run_again_fails_the_same_way(
        capsys, home, ckpt, broken_comfyui):
    argv = ["--ckpt", str(ckpt), "--comfyui", str(broken_comfyui)]
    for attempt in range(2):
        assert demo.run(demo.parse_args(argv)) == 1
        err = capsys.readouterr().err
        assert ("[demo] failed: ComfyUI did not start: ComfyUI exited with 1; its log ends with: "
                "this ComfyUI cannot start\n") in err, (attempt, err)
        assert _left_behind(home, broken_comfyui) == ([], []), attempt
    assert ckpt.read_bytes() == b"not really a model"


def test_a_failed_build_of_the_random_checkpoint_leaves_no_partial_file(capsys, home, broken_comfyui):
    """The random checkpoint is built with the ComfyUI's own classes: one it cannot import fails the build."""
    assert demo.run(demo.parse_args(["--comfyui", str(broken_comfyui)])) == 1
    err = capsys.readouterr().err
    assert "[demo] failed: building the random checkpoint failed: ModuleNotFoundError: No module named 'comfy." in err
    assert "[demo] the log: %s" % (home / "build_checkpoint.log") in err
    assert _left_behind(home, broken_comfyui) == ([], [])


def test_a_stale_link_of_an_older_demo_is_replaced_for_the_run_and_removed(home, ckpt, tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir()
    os.symlink("/gone/my_model.safetensors", ckpt_dir / ckpt.name)   # dangling, as older demos left it
    with demo.linked_checkpoint(str(ckpt), str(ckpt_dir)) as name:
        assert name == ckpt.name
        assert os.path.samefile(ckpt_dir / name, ckpt)
    assert os.listdir(ckpt_dir) == []


def test_a_cached_file_of_the_same_name_is_never_replaced(home, ckpt, tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir()
    theirs = ckpt_dir / ckpt.name
    theirs.write_bytes(b"another model")
    with pytest.raises(demo.RunFailed, match="rename one of them"):
        with demo.linked_checkpoint(str(ckpt), str(ckpt_dir)):
            pass
    assert theirs.read_bytes() == b"another model"
    with demo.linked_checkpoint(str(theirs), str(ckpt_dir)) as name:   # the cached file itself: used as is
        assert name == ckpt.name
    assert theirs.read_bytes() == b"another model"


def test_a_pack_link_the_user_had_is_kept(home, broken_comfyui):
    mine = broken_comfyui / "custom_nodes" / comfy_server.PACK_DIR_NAME
    os.symlink(REPO, mine)
    with demo.pack_unlinked_after(str(broken_comfyui)):
        pass
    assert os.path.islink(mine)


def test_the_pack_cloned_into_custom_nodes_is_used_where_it_is(tmp_path):
    """The README's install (git clone into custom_nodes/ComfyUI-SD-Accel), then the demo run from that
    clone against its ComfyUI: the clone itself is the pack, nothing is linked."""
    comfy_dir = tmp_path / "ComfyUI"
    clone = comfy_dir / "custom_nodes" / comfy_server.PACK_DIR_NAME
    clone.mkdir(parents=True)
    assert comfy_server.link_pack(str(comfy_dir), repo=str(clone)) == str(clone)
    assert not os.path.islink(clone)
    other = tmp_path / "another-checkout"
    other.mkdir()
    with pytest.raises(RuntimeError, match="exists and is not a symlink"):
        comfy_server.link_pack(str(comfy_dir), repo=str(other))
