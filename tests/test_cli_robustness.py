"""Every command, fed the bad input an operator will feed it, fails well: a one-line error, a non-zero exit,
in bounded time, and never a traceback.

The commands come from the CLI itself (click's command tree): a new command without cases here fails
`test_every_command_has_bad_inputs`. Everything is real: the installed `batchlens` in a subprocess, a port
nobody listens on, a server that accepts and never answers, a web server that speaks HTML where an API was
expected (harness/misbehaving.py), files that are not what they should be.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from batchlens.cli import main
from harness.exporter import BATCHLENS
from harness.misbehaving import HtmlServer, SilentServer
from harness.procs import free_port

pytestmark = pytest.mark.slow
BOUND = 30  # seconds: the longest any bad input may take to be refused (a wedged engine: the 10 s admin timeout)

#: command -> (case, argv). {name}s are filled from the `where` fixture.
CASES: dict[str, list[tuple[str, list[str]]]] = {
    "exporter": [
        ("url without scheme", ["--engine", "a=127.0.0.1:8000"]),
        ("listen without port", ["--listen", "nohost"]),
        ("malformed config", ["--config", "{yaml}"]),
        ("taken port", ["--listen", "127.0.0.1:{taken}", "--engine", "a={refused}"]),
    ],
    "remediate": [
        ("alertmanager without scheme", ["--config", "{engines}", "--alertmanager", "127.0.0.1:9093"]),
        ("corrupt state file", ["--config", "{engines}", "--state", "{text}", "--listen", "127.0.0.1:{free}"]),
        ("no engines", ["--config", "{empty}"]),
        ("taken port", ["--config", "{engines}", "--listen", "127.0.0.1:{taken}", "--state", "{tmp}/s.sqlite"]),
    ],
    "simulate": [
        ("listen without port", ["--listen", "nohost"]),
        ("taken port", ["--listen", "127.0.0.1:{taken}"]),
        ("zero capacity", ["--max-num-seqs", "0"]),
    ],
    "load": [
        ("url without scheme", ["--url", "127.0.0.1:8000"]),
        ("refused", ["--url", "{refused}", "--duration", "1"]),
        ("never answers", ["--url", "{silent}", "--duration", "1", "--timeout", "2"]),
        ("wrong protocol", ["--url", "{html}", "--duration", "1"]),
        ("zero tokens", ["--url", "{refused}", "--prompt-tokens", "0"]),
    ],
    "build": [
        ("unwritable root", ["--root", "{unwritable}"]),
        ("malformed config", ["--config", "{yaml}", "--root", "{tmp}/out"]),
    ],
    "report": [
        ("url without scheme", ["--prometheus", "127.0.0.1:9090", "--out", "{tmp}/r"]),
        ("refused", ["--prometheus", "{refused}", "--out", "{tmp}/r"]),
        ("never answers", ["--prometheus", "{silent}", "--timeout", "2", "--out", "{tmp}/r"]),
        ("wrong protocol", ["--prometheus", "{html}", "--out", "{tmp}/r"]),
        ("unwritable out", ["--prometheus", "{refused}", "--out", "{unwritable}"]),
        ("bad range", ["--prometheus", "{refused}", "--range", "soon", "--out", "{tmp}/r"]),
    ],
    "demo": [
        ("unwritable run folder", ["--run-dir", "{unwritable}"]),
        ("taken port", ["--run-dir", "{tmp}/demo", "--port-offset", "{taken_offset}"]),
    ],
    "advise": [
        ("url without scheme", ["--prometheus", "127.0.0.1:9090"]),
        ("refused", ["--prometheus", "{refused}"]),
        ("never answers", ["--prometheus", "{silent}", "--timeout", "2"]),
        ("wrong protocol", ["--prometheus", "{html}"]),
        ("zero resolution", ["--prometheus", "{refused}", "--resolution", "0s"]),
    ],
    "sweep": [
        ("url without scheme", ["--engine", "127.0.0.1:8000", "--out", "{tmp}/s"]),
        ("refused", ["--engine", "{refused}", "--out", "{tmp}/s"]),
        ("never answers", ["--engine", "{silent}", "--out", "{tmp}/s"]),
        ("wrong protocol", ["--engine", "{html}", "--out", "{tmp}/s"]),
        ("unwritable out", ["--engine", "{refused}", "--out", "{unwritable}"]),
        ("bad limits", ["--engine", "{refused}", "--limits", "0,a"]),
        ("exporter without scheme", ["--engine", "{refused}", "--exporter", "127.0.0.1:9400"]),
    ],
    "replay": [
        ("malformed trace", ["{text}", "--simulated"]),
        ("empty trace", ["{empty_trace}", "--simulated"]),
        ("unsorted trace", ["{unsorted}", "--simulated"]),
        ("huge trace line", ["{huge}", "--simulated"]),
        ("unknown format", ["{unsorted}", "--simulated", "--format", "parquet"]),
        ("zero SLO", ["{unsorted}", "--simulated", "--slo-ttft", "0"]),
        ("unwritable out", ["{unsorted}", "--simulated", "--out", "{unwritable}"]),
        ("url down", ["{unsorted}", "--url", "{refused}"]),
        ("url never answers", ["{unsorted}", "--url", "{silent}"]),
        ("url of another protocol", ["{unsorted}", "--url", "{html}"]),
        ("two targets", ["{unsorted}", "--simulated", "--url", "{refused}"]),
        ("a policy against a url", ["{unsorted}", "--url", "{refused}", "--policy", "static:4"]),
    ],
    "lint-config": [
        ("missing file", ["{tmp}/nothing.yaml"]),
        ("malformed yaml", ["{yaml}"]),
        ("not a config", ["{text}"]),
    ],
    "doctor": [
        ("malformed config", ["--config", "{yaml}"]),
        ("missing host root", ["--host-root", "{tmp}/nothing"]),
    ],
    "config show": [
        ("missing file", ["--config", "{tmp}/nothing.yaml"]),
        ("malformed config", ["--config", "{yaml}"]),
        ("out-of-range value", ["--config", "{out_of_range}"]),
    ],
}


def leaf_commands(group: click.Group = main, prefix: str = "") -> Iterator[str]:
    ctx = click.Context(group)
    for name in sorted(group.list_commands(ctx)):
        command = group.get_command(ctx, name)
        if isinstance(command, click.Group):
            yield from leaf_commands(command, f"{prefix}{name} ")
        else:
            yield prefix + name


def test_every_command_has_bad_inputs() -> None:
    assert sorted(leaf_commands()) == sorted(CASES), "each command of the CLI needs its bad inputs in CASES"


@pytest.fixture(scope="module")
def where(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("robust")
    (tmp / "text").write_text("hello, I am not what you think\n")
    (tmp / "broken.yaml").write_text("engines: [\n  - url: http://127.0.0.1:8000\n")
    (tmp / "engines.yaml").write_text("engines:\n  - url: http://127.0.0.1:1\n")
    (tmp / "empty.yaml").write_text("exporter: {}\n")
    (tmp / "out_of_range.yaml").write_text("exporter:\n  interval_seconds: -1\n")
    line = '{{"t": {t}, "prompt_tokens": 8, "output_tokens": 8}}\n'
    (tmp / "unsorted.jsonl").write_text(line.format(t=5) + line.format(t=1))
    (tmp / "huge.jsonl").write_text(line.format(t=1).replace("}", ', "x": "' + "x" * 100_000 + '"}'))
    (tmp / "empty.jsonl").write_text("")
    silent, html = SilentServer(), HtmlServer()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        yield {
            "tmp": str(tmp), "text": str(tmp / "text"), "yaml": str(tmp / "broken.yaml"),
            "engines": str(tmp / "engines.yaml"), "empty": str(tmp / "empty.yaml"),
            "out_of_range": str(tmp / "out_of_range.yaml"), "unwritable": str(tmp / "text" / "out"),
            "unsorted": str(tmp / "unsorted.jsonl"), "huge": str(tmp / "huge.jsonl"),
            "empty_trace": str(tmp / "empty.jsonl"),
            "refused": f"http://127.0.0.1:{free_port()}", "silent": silent.url, "html": html.url,
            "taken": str(port), "taken_offset": str(port - 8000), "free": str(free_port()),
        }  # fmt: skip
    silent.close()
    html.close()


@pytest.mark.parametrize(
    ("command", "case", "argv"),
    [(command, case, argv) for command, cases in CASES.items() for case, argv in cases],
    ids=[f"{command}: {case}" for command, cases in CASES.items() for case, _ in cases],
)
def test_bad_input_fails_with_one_line_in_bounded_time(where, command: str, case: str, argv: list[str]) -> None:
    args = [*command.split(), *(arg.format(**where) for arg in argv)]
    env = {"BATCHLENS_ADMIN_TOKEN": "t", "BATCHLENS_WEBHOOK_TOKEN": "t", "PATH": str(Path(BATCHLENS).parent)}
    started = time.monotonic()
    done = subprocess.run([BATCHLENS, *args], capture_output=True, text=True, timeout=BOUND + 15, env=env,
                          stdin=subprocess.DEVNULL)  # fmt: skip
    took = time.monotonic() - started
    said = f"batchlens {' '.join(args)} -> {done.returncode} in {took:.1f}s\n{done.stdout[-1500:]}{done.stderr[-1500:]}"
    assert done.returncode != 0, said
    assert "Traceback" not in done.stdout + done.stderr, said
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and len(errors[0]) > len("Error: ") + 10, said
    assert took < BOUND, said
    if case == "taken port":  # "listening" is said only once the socket is bound
        assert "listening" not in done.stderr and "webhook on" not in done.stderr, said
    print(f"{command} ({case}): {errors[0]} [{took:.1f}s]")
