"""`kvloop generate` / `kvloop chat` through a resident `kvloop serve` (issue 27).

Each server runs as a subprocess with its run-file directory (KVLOOP_RUNTIME_DIR) under
the test's tmp dir, so no test ever sees a user's server, nor a user a test's. The CLI runs
as a subprocess too (the real entry point), each call bounded by a timeout: nothing hangs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import write_tiny_model
from kvloop.cli import main
from kvloop.server import control

SRC = str(Path(__file__).resolve().parents[1] / "src")
CLI_TIMEOUT_S = 180  # a subprocess that takes longer has hung
SERVE_TIMEOUT_S = 180  # model load on a busy machine
TINY = ["--kv-cache-memory", "32MiB"]  # the engine flags every tiny-model command uses


def env_for(run_dir: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "KVLOOP_RUNTIME_DIR": str(run_dir), "KVLOOP_API_KEY": "",
           "KVLOOP_SERVER": "", "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.update(extra)
    return env


@dataclass
class Run:
    rc: int
    out: str
    err: str


def kvloop(run_dir: Path, *args: str, stdin: str | None = None, timeout: float = CLI_TIMEOUT_S,
           **env: str) -> Run:
    p = subprocess.run([sys.executable, "-m", "kvloop.cli", *args], input=stdin,
                       capture_output=True, text=True, timeout=timeout,
                       env=env_for(run_dir, **env))
    return Run(p.returncode, p.stdout, p.stderr)


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    info: dict[str, object]
    log: Path

    @property
    def url(self) -> str:
        return str(self.info["url"])


def run_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("serve-*.json"))


@contextmanager
def serve(run_dir: Path, model: Path | None, *flags: str, **env: str) -> Iterator[Server]:
    """`kvloop serve` on a free port; ready once its run file is written (it is written
    when the server accepts connections)."""
    log = run_dir / f"serve-{time.monotonic_ns()}.log"
    model_flags = ["--model", str(model)] if model is not None else []
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvloop.cli", "serve", *model_flags, "--port", "0", *flags],
            stdout=out, stderr=subprocess.STDOUT, env=env_for(run_dir, **env))
    path = run_dir / f"serve-{proc.pid}.json"
    try:
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while not path.exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
        yield Server(proc, json.loads(path.read_text()), log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("run")


@pytest.fixture(scope="module")
def tiny_server(run_dir: Path, tiny_model_dir: Path) -> Iterator[Server]:
    with serve(run_dir, tiny_model_dir, *TINY) as server:
        yield server


# -- CLI polish -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "hint"), [
    ([], "(see kvloop -h)"),
    (["generate", "--max-tokens", "x"], "(see kvloop generate -h)"),
    (["chat", "--top-k", "x"], "(see kvloop chat -h)"),
    (["serve", "--port", "x"], "(see kvloop serve -h)"),
])
def test_usage_errors_name_the_program_once(argv: list[str], hint: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.startswith("kvloop: error: ") and err.rstrip().endswith(hint), err
    assert "kvloop kvloop" not in err


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "roofline", "ps", "stop"])
def test_usage_line_names_the_program_once(command: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "-h"])
    usage = capsys.readouterr().out.splitlines()[0]
    assert usage.startswith(f"usage: kvloop {command} ") and usage.count("kvloop") == 1


# -- the run file ---------------------------------------------------------------------------------
def test_serve_writes_its_run_file_and_removes_it_on_exit(tmp_path: Path,
                                                          tiny_model_dir: Path) -> None:
    with serve(tmp_path, tiny_model_dir, *TINY) as server:
        info = server.info
        assert info["pid"] == server.proc.pid
        assert str(info["url"]).startswith("http://127.0.0.1:")
        assert info["model"] == tiny_model_dir.name
        identity = info["model_identity"]
        assert isinstance(identity, dict) and identity["path"] == str(tiny_model_dir.resolve())
        options = info["engine_options"]
        assert isinstance(options, dict) and options["kv_cache_memory"] == "32MiB"
        assert info["api_key_required"] is False
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
    assert run_files(tmp_path) == []


# -- generate through the resident engine ---------------------------------------------------------
def test_greedy_generate_is_the_same_through_the_server(run_dir: Path, tiny_server: Server,
                                                       tiny_model_dir: Path) -> None:
    args = ["generate", "The quick brown", "--max-tokens", "12", "--json",
            "--model", str(tiny_model_dir), *TINY]
    remote, local = kvloop(run_dir, *args), kvloop(run_dir, *args, "--local")
    assert remote.rc == local.rc == 0, remote.err + local.err
    r, l_ = json.loads(remote.out), json.loads(local.out)
    assert r.keys() == l_.keys() and r["metrics"].keys() == l_["metrics"].keys()
    assert r["text"] == l_["text"] and r["token_ids"] == l_["token_ids"]
    assert len(r["token_ids"]) == r["metrics"]["output_tokens"] == 12
    assert r["load_seconds"] == 0.0 and l_["load_seconds"] > 0  # no model load: the server's
    assert "POST /v1/completions" in tiny_server.log.read_text()


def test_streamed_text_and_figures_line_are_the_same(run_dir: Path, tiny_server: Server,
                                                     tiny_model_dir: Path) -> None:
    args = ["generate", "def f(x):", "--max-tokens", "10", "--logprobs", "2",
            "--model", str(tiny_model_dir), *TINY]
    remote, local = kvloop(run_dir, *args), kvloop(run_dir, *args, "--local")
    assert remote.rc == local.rc == 0, remote.err + local.err
    assert remote.out == local.out and remote.out.endswith("\n")
    for run in (remote, local):
        figures = run.err.strip().splitlines()[-1]
        assert figures.startswith("[TTFT ") and "| 10 tokens |" in figures, run.err


def test_json_with_logprobs_and_beams_match_local(run_dir: Path, tiny_server: Server,
                                                  tiny_model_dir: Path) -> None:
    for extra in (["--logprobs", "2"], ["--num-beams", "2", "--num-return-sequences", "2"]):
        args = ["generate", "Caf", "--max-tokens", "6", "--json", *extra, *TINY]
        remote, local = kvloop(run_dir, *args), kvloop(
            run_dir, *args, "--local", "--model", str(tiny_model_dir))
        assert remote.rc == local.rc == 0, remote.err + local.err
        r, l_ = json.loads(remote.out), json.loads(local.out)
        assert r.keys() == l_.keys()
        for key in ("text", "token_ids", "logprobs", "top_logprobs", "outputs"):
            if key not in l_:
                continue
            if key == "outputs":
                assert [(o["text"], o["token_ids"]) for o in r[key]] == \
                    [(o["text"], o["token_ids"]) for o in l_[key]]
            elif key in ("logprobs",):
                assert r[key] == pytest.approx(l_[key], abs=1e-4)
            elif key == "top_logprobs":
                assert [[t for t, _ in row] for row in r[key]] == \
                    [[t for t, _ in row] for row in l_[key]]
            else:
                assert r[key] == l_[key]


def test_the_client_path_does_not_import_torch(run_dir: Path, tiny_server: Server) -> None:
    """The remote path loads no engine library, and no HTTP library beyond the standard
    one: importing httpx (and the rich / click its package imports) was ~0.1 s of a
    ~0.3 s command."""
    code = ("import sys\nfrom kvloop.cli import main\n"
            "rc = main(['generate', 'The quick', '--max-tokens', '4', '--kv-cache-memory', "
            "'32MiB'])\n"
            "print('RC', rc, 'TORCH', 'torch' in sys.modules, 'TOKENIZERS', "
            "'tokenizers' in sys.modules, 'HTTPX', 'httpx' in sys.modules, "
            "'CLIENT', 'kvloop.client' in sys.modules, file=sys.stderr)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=CLI_TIMEOUT_S, env=env_for(run_dir))
    assert "RC 0 TORCH False TOKENIZERS False HTTPX False CLIENT True" in p.stderr, p.stderr
    assert p.stdout.strip()


def test_explicit_server_url_is_used(tmp_path: Path, tiny_server: Server) -> None:
    """--server reaches a server no run file names (here: another run-file directory)."""
    run = kvloop(tmp_path, "generate", "The", "--max-tokens", "3", "--json", *TINY,
                 "--server", tiny_server.url)
    assert run.rc == 0, run.err
    assert json.loads(run.out)["load_seconds"] == 0.0
    env_run = kvloop(tmp_path, "generate", "The", "--max-tokens", "3", "--json", *TINY,
                     KVLOOP_SERVER=tiny_server.url)
    assert env_run.rc == 0 and json.loads(env_run.out)["load_seconds"] == 0.0, env_run.err


# -- chat, fallbacks, failures ------------------------------------------------------------------
def test_chat_keeps_the_conversation(run_dir: Path, tiny_server: Server,
                                     tiny_model_dir: Path) -> None:
    """Two lines on stdin: the second turn is sent with the first turn and its reply, so
    the server's second prompt is longer, and the replies equal a local session's."""
    args = ["chat", "--max-tokens", "6", "--model", str(tiny_model_dir), *TINY]
    lines = "The quick brown\nfox jumps\n"
    before = tiny_server.log.read_text().count("chatcmpl-")
    remote, local = (kvloop(run_dir, *args, stdin=lines),
                     kvloop(run_dir, *args, "--local", stdin=lines))
    assert remote.rc == local.rc == 0, remote.err + local.err
    assert remote.out == local.out and remote.out.count(">>> ") == 3
    assert sum(ln.startswith("[TTFT") for ln in remote.err.splitlines()) == 2
    finished = [ln for ln in tiny_server.log.read_text().splitlines()
                if "chatcmpl-" in ln and " finished: " in ln][before:]
    prompts = [int(ln.split("| prompt ")[1].split()[0]) for ln in finished]
    assert len(prompts) == 2 and prompts[1] > prompts[0] + 6, finished


def test_another_model_or_options_fall_back_with_one_line(
        run_dir: Path, tiny_server: Server, tiny_model_dir: Path, tmp_path: Path) -> None:
    other = write_tiny_model(tmp_path / "other-tiny", seed=1)
    for flags, said in ((["--model", str(other), *TINY], "serves "),
                        (["--model", str(tiny_model_dir), "--kv-cache-memory", "16MiB"],
                         "(--kv-cache-memory: '32MiB' there, '16MiB' asked)")):
        run = kvloop(run_dir, "generate", "The", "--max-tokens", "3", "--json", *flags)
        assert run.rc == 0, run.err
        notes = run.err.strip().splitlines()
        assert len(notes) == 1 and notes[0].startswith("kvloop: the engine at ") \
            and said in notes[0] and notes[0].endswith("running one-shot"), run.err
        assert json.loads(run.out)["load_seconds"] > 0  # loaded here: one-shot


def test_a_stale_run_file_is_ignored_and_removed(tmp_path: Path, tiny_model_dir: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    base = {"model": "x", "model_identity": {}, "engine_options": {}, "started": time.time()}
    (tmp_path / f"serve-{dead.pid}.json").write_text(json.dumps(
        {**base, "url": "http://127.0.0.1:9", "pid": dead.pid}))
    # A live pid (this test's) whose address refuses connections: the server lost it.
    (tmp_path / f"serve-{os.getpid()}.json").write_text(json.dumps(
        {**base, "url": "http://127.0.0.1:9", "pid": os.getpid()}))
    (tmp_path / "serve-1.json").write_text("{not json")
    run = kvloop(tmp_path, "generate", "The", "--max-tokens", "3", "--json",
                 "--model", str(tiny_model_dir), *TINY)
    assert run.rc == 0 and run.err == "", run.err
    assert json.loads(run.out)["load_seconds"] > 0
    assert run_files(tmp_path) == []


def test_a_server_killed_mid_stream_is_one_error_and_exit_1(tmp_path: Path,
                                                            tiny_model_dir: Path) -> None:
    with serve(tmp_path, tiny_model_dir, *TINY) as server:
        cli = subprocess.Popen(
            [sys.executable, "-m", "kvloop.cli", "generate", "The", "--max-tokens", "2000",
             "--ignore-eos", *TINY], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env_for(tmp_path))
        try:
            assert cli.stdout is not None and cli.stdout.read(1)  # the answer has begun
            server.proc.kill()
            _, err = cli.communicate(timeout=60)
        finally:
            if cli.poll() is None:
                cli.kill()
    assert cli.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvloop: error: lost the engine at "), err


def test_the_api_key_is_required_when_set(tmp_path: Path, tiny_model_dir: Path) -> None:
    with serve(tmp_path, tiny_model_dir, *TINY, KVLOOP_API_KEY="s3cret") as server:
        assert server.info["api_key_required"] is True
        assert "s3cret" not in json.dumps(server.info)  # never written down
        args = ["generate", "The", "--max-tokens", "3", "--json", *TINY]
        without, wrong, right = (kvloop(tmp_path, *args),
                                 kvloop(tmp_path, *args, KVLOOP_API_KEY="nope"),
                                 kvloop(tmp_path, *args, KVLOOP_API_KEY="s3cret"))
    for run in (without, wrong):
        assert run.rc == 1 and run.out == "", run.err
        assert run.err.startswith("kvloop: error: ") and "KVLOOP_API_KEY" in run.err
        assert run.err.count("\n") == 1
    assert right.rc == 0 and json.loads(right.out)["load_seconds"] == 0.0, right.err


@pytest.mark.slow
def test_default_model_chat_prompt_is_the_same_through_the_server(tmp_path: Path) -> None:
    """The real model: generate --chat (template applied by the server) matches --local."""
    with serve(tmp_path, None):
        args = ["generate", "What is 2+2?", "--chat", "--max-tokens", "8", "--json"]
        remote, local = kvloop(tmp_path, *args), kvloop(tmp_path, *args, "--local")
    assert remote.rc == local.rc == 0, remote.err + local.err
    r, l_ = json.loads(remote.out), json.loads(local.out)
    assert r.keys() == l_.keys()
    assert (r["text"], r["token_ids"]) == (l_["text"], l_["token_ids"])
    assert r["load_seconds"] == 0.0


# -- serve --detach, ps, stop ---------------------------------------------------------------------
def test_detach_ps_and_stop_end_to_end(tmp_path: Path, tiny_model_dir: Path) -> None:
    r = kvloop(tmp_path, "serve", "--detach", "--model", str(tiny_model_dir), "--port", "0",
               *TINY)
    assert r.rc == 0 and "kvloop stop" in r.out, r.err
    [path] = run_files(tmp_path)
    info = json.loads(path.read_text())
    pid = int(info["pid"])
    try:
        assert os.getsid(pid) == pid  # a session of its own: the shell's Ctrl-C is not its
        assert Path(str(info["log"])).is_file() and info["url"] in r.out
        gen = kvloop(tmp_path, "generate", "The", "--max-tokens", "3", "--json", *TINY)
        assert gen.rc == 0 and json.loads(gen.out)["load_seconds"] == 0.0, gen.err  # remote

        listed = kvloop(tmp_path, "ps")
        assert listed.rc == 0, listed.err
        header, row = listed.out.splitlines()
        assert header.split() == ["PID", "MODEL", "URL", "UPTIME", "REQUESTS", "OPTIONS"]
        cells = row.split()
        assert (cells[0], cells[2], cells[4]) == (str(pid), info["url"], "1")
        assert cells[5:] == ["kv_cache_memory=32MiB"]  # only what differs from the defaults

        stopped = kvloop(tmp_path, "stop")
        assert stopped.rc == 0 and f"(pid {pid})" in stopped.out, stopped.err
        assert control.exited(pid) and run_files(tmp_path) == []
    finally:
        if not control.exited(pid):
            os.kill(pid, signal.SIGKILL)
    assert kvloop(tmp_path, "ps").out == "no kvloop serve is running\n"
    again = kvloop(tmp_path, "stop")
    assert again.rc == 1 and again.err.startswith("kvloop: error: no kvloop serve")
    assert again.err.count("\n") == 1


def test_detach_reports_the_servers_own_error(tmp_path: Path) -> None:
    """A model that cannot load: the detached server's own error line, its status (2)."""
    r = kvloop(tmp_path, "serve", "--detach", "--model", str(tmp_path / "missing.gguf"),
               "--port", "0")
    assert r.rc == 2 and r.out == "", r.err
    assert r.err.startswith("kvloop: error: the server exited with status 2") and \
        "missing.gguf" in r.err and r.err.count("\n") == 1, r.err
    assert run_files(tmp_path) == []


def test_the_one_shot_path_does_not_import_httpx(tmp_path: Path, tiny_model_dir: Path) -> None:
    """With no server to reach (no run file, no --server), generate runs one-shot without
    importing kvloop.client and httpx (~80 ms of every one-shot start), without the
    grammar engine when it asks for no structured output (~0.13 s), and without tqdm.auto
    (asyncio with it) when it shows no progress bar (torch imports plain tqdm itself)."""
    code = ("import sys; from kvloop.cli import main; "
            f"rc = main(['generate', 'The', '--max-tokens', '2', '--model', "
            f"{str(tiny_model_dir)!r}, '--kv-cache-memory', '32MiB']); "
            "print('\\nIMPORTED', 'httpx' in sys.modules, 'kvloop.client' in sys.modules, "
            "'llguidance' in sys.modules, 'tqdm.auto' in sys.modules, rc)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=CLI_TIMEOUT_S, env=env_for(tmp_path / "run"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "IMPORTED False False False False 0", p.stdout
