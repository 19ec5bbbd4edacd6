"""Every command, fed the bad input an operator will feed it, fails well: a one-line error, a non-zero exit,
in bounded time, and never a traceback.

The commands come from the CLI itself (click's command tree): a new command without cases here fails
`test_every_command_has_bad_inputs`. Everything is real: the installed `batchlens` in a subprocess, a port
nobody listens on, a server that accepts and never answers, a web server that speaks HTML where an API was
expected (harness/misbehaving.py), files that are not what they should be.
"""

from __future__ import annotations

import re
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

#: command -> (case, argv, what the one error line must say). {name}s are filled from the `where` fixture. Every
#: input but the case's own is valid, so the error shown is the case's and no other (an unreachable URL beside a
#: broken trace would be refused for the trace, and prove nothing about the URL).
CASES: dict[str, list[tuple[str, list[str], str]]] = {
    "exporter": [
        ("url without scheme", ["--engine", "a=127.0.0.1:8000"], "http://"),
        ("listen without port", ["--listen", "nohost"], "HOST:PORT"),
        ("malformed config", ["--config", "{yaml}"], "broken.yaml"),
        ("taken port", ["--listen", "127.0.0.1:{taken}", "--engine", "a={refused}"], "{taken}"),
    ],
    "remediate": [
        ("alertmanager without scheme", ["--config", "{engines}", "--alertmanager", "127.0.0.1:9093"], "http://"),
        (
            "corrupt state file",
            ["--config", "{engines}", "--state", "{text}", "--listen", "127.0.0.1:{free}"],
            "not a batchlens state database",
        ),
        ("no engines", ["--config", "{empty}"], "no engines configured"),
        (
            "taken port",
            ["--config", "{engines}", "--listen", "127.0.0.1:{taken}", "--state", "{tmp}/s.sqlite"],
            "{taken}",
        ),
    ],
    "simulate": [
        ("listen without port", ["--listen", "nohost"], "HOST:PORT"),
        ("taken port", ["--listen", "127.0.0.1:{taken}"], "{taken}"),
        ("zero capacity", ["--max-num-seqs", "0"], "--max-num-seqs"),
    ],
    "load": [
        ("url without scheme", ["--url", "127.0.0.1:8000"], "http://"),
        ("refused", ["--url", "{refused}", "--duration", "1"], "{refused_port}"),
        ("never answers", ["--url", "{silent}", "--duration", "1", "--timeout", "2"], "within"),
        ("wrong protocol", ["--url", "{html}", "--duration", "1"], "did not answer an OpenAI model list"),
        ("zero tokens", ["--url", "{refused}", "--prompt-tokens", "0"], "--prompt-tokens"),
    ],
    "build": [
        ("unwritable root", ["--root", "{unwritable}"], "--root"),
        ("malformed config", ["--config", "{yaml}", "--root", "{tmp}/out"], "broken.yaml"),
        (
            "long engine shorter than a long prompt",
            ["--config", "{short_long}", "--root", "{tmp}/out"],
            "could take none",
        ),
        ("stale root", ["--check", "--root", "{tmp}/never-built"], "run `batchlens build --root {tmp}/never-built`"),
    ],
    "report": [
        ("url without scheme", ["--prometheus", "127.0.0.1:9090", "--out", "{tmp}/r"], "http://"),
        ("refused", ["--prometheus", "{refused}", "--out", "{tmp}/r"], "{refused_port}"),
        ("never answers", ["--prometheus", "{silent}", "--timeout", "2", "--out", "{tmp}/r"], "did not answer"),
        ("wrong protocol", ["--prometheus", "{html}", "--out", "{tmp}/r"], "is not a Prometheus API"),
        ("unwritable out", ["--prometheus", "{refused}", "--out", "{unwritable}"], "--out"),
        ("bad range", ["--prometheus", "{refused}", "--range", "soon", "--out", "{tmp}/r"], "--range"),
        ("watch on a taken port", ["--prometheus", "{refused}", "--watch", "--listen", "127.0.0.1:{taken}"], "{taken}"),
    ],
    "demo": [
        ("unwritable run folder", ["--run-dir", "{unwritable}"], "--run-dir"),
        ("taken port", ["--run-dir", "{tmp}/demo", "--port-offset", "{taken_offset}"], "is taken"),
    ],
    "advise": [
        ("url without scheme", ["--prometheus", "127.0.0.1:9090"], "http://"),
        ("refused", ["--prometheus", "{refused}"], "{refused_port}"),
        ("never answers", ["--prometheus", "{silent}", "--timeout", "2"], "did not answer"),
        ("wrong protocol", ["--prometheus", "{html}"], "is not a Prometheus API"),
        ("zero resolution", ["--prometheus", "{refused}", "--resolution", "0s"], "--resolution"),
    ],
    "sweep": [
        ("url without scheme", ["--engine", "127.0.0.1:8000", "--out", "{tmp}/s"], "http://"),
        ("refused", ["--engine", "{refused}", "--out", "{tmp}/s"], "{refused_port}"),
        ("never answers", ["--engine", "{silent}", "--out", "{tmp}/s"], "within"),
        ("wrong protocol", ["--engine", "{html}", "--out", "{tmp}/s"], "admin API"),
        ("unwritable out", ["--engine", "{refused}", "--out", "{unwritable}"], "--out"),
        ("bad limits", ["--engine", "{refused}", "--limits", "0,a", "--out", "{tmp}/s"], "--limits"),
        (
            "exporter without scheme",
            ["--engine", "{refused}", "--exporter", "127.0.0.1:9400", "--out", "{tmp}/s"],
            "--exporter",
        ),
    ],
    "replay": [
        ("malformed trace", ["{text}", "--simulated"], "text:1: not JSON"),
        ("empty trace", ["{empty_trace}", "--simulated"], "no requests to replay"),
        ("unsorted trace", ["{unsorted}", "--simulated"], "unsorted.jsonl:2: time goes back"),
        ("huge trace line", ["{huge}", "--simulated"], "not a trace line"),
        ("unknown format", ["{good}", "--simulated", "--format", "parquet"], "--format"),
        ("zero SLO", ["{good}", "--simulated", "--slo-ttft", "0"], "--slo-ttft"),
        ("unwritable out", ["{good}", "--simulated", "--out", "{unwritable}"], "--out"),
        ("url down", ["{good}", "--url", "{refused}"], "{refused_port}"),
        ("url never answers", ["{good}", "--url", "{silent}"], "within"),
        ("url of another protocol", ["{good}", "--url", "{html}"], "did not answer an OpenAI model list"),
        ("two targets", ["{good}", "--simulated", "--url", "{refused}"], "not both"),
        ("a policy against a url", ["{good}", "--url", "{refused}", "--policy", "static:4"], "need --simulated"),
        ("a year-long gap, drawn", ["{gap}", "--simulated", "--out", "{tmp}/gap"], "gap.jsonl:2:"),
        ("a time past any clock", ["{far}", "--simulated"], "far.jsonl:2:"),
        ("a rate scale of nothing", ["{good}", "--simulated", "--rate-scale", "1e-9"], "--rate-scale"),
        ("NaN for a time", ["{nan}", "--simulated"], "nan.jsonl:2: the time nan"),
        ("Infinity for a time", ["{inf_csv}", "--simulated", "--format", "burstgpt"], "inf.csv:3: the time inf"),
        ("no output in jsonl", ["{zero_out}", "--simulated"], "zero_out.jsonl:2: output_tokens 0"),
        ("half a token", ["{fraction}", "--simulated"], "fraction.jsonl:1: the prompt length 100.5"),
        ("a start past the end", ["{good}", "--simulated", "--start", "1000"], "past the trace's end"),
        (
            "a served model in simulated time",
            ["{good}", "--simulated", "--served-model-name", "m"],
            "--served-model-name",
        ),
    ],
    "plan": [
        ("malformed trace", ["{text}"], "text:1: not JSON"),
        ("price without a number", ["{good}", "--price", "h100=cheap"], "--price"),
        ("unwritable out", ["{good}", "--out", "{unwritable}"], "--out"),
        ("unknown policy", ["{good}", "--policy", "fastest"], "--policy"),
    ],
    "lint-config": [
        ("missing file", ["{tmp}/nothing.yaml"], "nothing.yaml"),
        ("malformed yaml", ["{yaml}"], "broken.yaml"),
        ("not a config", ["{text}"], "text"),
    ],
    "doctor": [
        ("malformed config", ["--config", "{yaml}"], "broken.yaml"),
        ("missing host root", ["--host-root", "{tmp}/nothing"], "--host-root"),
    ],
    "config show": [
        ("missing file", ["--config", "{tmp}/nothing.yaml"], "nothing.yaml"),
        ("malformed config", ["--config", "{yaml}"], "broken.yaml"),
        ("out-of-range value", ["--config", "{out_of_range}"], "interval_seconds"),
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
    (tmp / "good.jsonl").write_text(line.format(t=0) + line.format(t=1) + line.format(t=2))
    (tmp / "gap.jsonl").write_text(line.format(t=0) + line.format(t=1e9))
    (tmp / "far.jsonl").write_text(line.format(t=0) + line.format(t=1e300))
    (tmp / "nan.jsonl").write_text(line.format(t=0) + line.format(t="NaN"))
    (tmp / "zero_out.jsonl").write_text(line.format(t=0) + '{"t": 1, "prompt_tokens": 8, "output_tokens": 0}\n')
    (tmp / "fraction.jsonl").write_text('{"t": 0, "prompt_tokens": 100.5, "output_tokens": 8}\n')
    (tmp / "inf.csv").write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "0,ChatGPT,8,8,16,Conversation log\nInfinity,ChatGPT,8,8,16,Conversation log\n"
    )
    (tmp / "short_long.yaml").write_text("routing: {model: m}\nengines:\n  - {url: 'http://127.0.0.1:1', "
                                         "role: long, max_model_len: 1000}\n")  # fmt: skip
    (tmp / "huge.jsonl").write_text(line.format(t=1).replace("}", ', "x": "' + "x" * 100_000 + '"}'))
    (tmp / "empty.jsonl").write_text("")
    silent, html, refused = SilentServer(), HtmlServer(), free_port()
    with socket.socket() as taken:
        port = free_port()  # within demo's --port-offset range above its base port 8000
        taken.bind(("127.0.0.1", port))
        taken.listen()
        yield {
            "tmp": str(tmp), "text": str(tmp / "text"), "yaml": str(tmp / "broken.yaml"),
            "engines": str(tmp / "engines.yaml"), "empty": str(tmp / "empty.yaml"),
            "out_of_range": str(tmp / "out_of_range.yaml"), "unwritable": str(tmp / "text" / "out"),
            "unsorted": str(tmp / "unsorted.jsonl"), "huge": str(tmp / "huge.jsonl"),
            "empty_trace": str(tmp / "empty.jsonl"), "good": str(tmp / "good.jsonl"), "gap": str(tmp / "gap.jsonl"),
            "far": str(tmp / "far.jsonl"), "nan": str(tmp / "nan.jsonl"), "zero_out": str(tmp / "zero_out.jsonl"),
            "fraction": str(tmp / "fraction.jsonl"), "inf_csv": str(tmp / "inf.csv"),
            "short_long": str(tmp / "short_long.yaml"),
            "refused": f"http://127.0.0.1:{refused}", "refused_port": str(refused), "silent": silent.url,
            "html": html.url,
            "taken": str(port), "taken_offset": str(port - 8000), "free": str(free_port()),
        }  # fmt: skip
    silent.close()
    html.close()


@pytest.mark.parametrize(
    ("command", "case", "argv", "cause"),
    [(command, case, argv, cause) for command, cases in CASES.items() for case, argv, cause in cases],
    ids=[f"{command}: {case}" for command, cases in CASES.items() for case, _, _ in cases],
)
def test_bad_input_fails_with_one_line_naming_its_cause_in_bounded_time(
    where, command: str, case: str, argv: list[str], cause: str
) -> None:
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
    assert cause.format(**where) in errors[0], f"the error does not name its cause ({cause!r}): {said}"
    assert took < BOUND, said
    if case == "taken port":  # "listening" is said only once the socket is bound
        assert "listening" not in done.stderr and "webhook on" not in done.stderr, said
    print(f"{command} ({case}): {errors[0]} [{took:.1f}s]")


README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def command_of(path: str) -> click.Command:
    command: click.Command = main
    for name in path.split():
        assert isinstance(command, click.Group)
        command = command.get_command(click.Context(command), name)
    return command


def synopsis(path: str) -> str:
    """README's synopsis of one command: its `batchlens <path> ...` lines and the indented text below them."""
    blocks = re.findall(rf"^batchlens {re.escape(path)}\b.*?(?=^\S|\Z)", README, flags=re.M | re.S)
    assert blocks, f"README.md has no synopsis for `batchlens {path}`"
    return "\n".join(blocks)


@pytest.mark.parametrize("path", sorted(CASES))
def test_every_commands_help_has_an_example_and_the_readme_names_its_options(path: str) -> None:
    command = command_of(path)
    assert "Example" in (command.help or ""), f"`batchlens {path} --help` shows no example"
    text = synopsis(path)
    # Not a hidden option: a renamed flag's old name, kept for a release (clikit.renamed_option)
    options = [[o for o in (*p.opts, *p.secondary_opts) if o.startswith("--")] for p in command.params
               if isinstance(p, click.Option) and not p.hidden]  # fmt: skip
    missing = sorted(names[0] for names in options if names and not any(o in text for o in names))
    assert not missing, f"README.md's synopsis of `batchlens {path}` lacks {missing}"


#: command line -> the warning `batchlens build` must print (and still succeed): settings that load, but do not
#: do what they seem to.
WARNINGS = {
    "roles without a routing model": ("engines:\n  - {url: 'http://127.0.0.1:1', role: interactive}\n",
                                      "routing.model is empty: no router config is written"),
    "a scraped proxy that wants its key": ("routing: {model: m}\nengines:\n  - {url: 'http://127.0.0.1:1'}\n",
                                           "scrapes it without one (HTTP 401)"),
    "a main engine shorter than the long bound": (
        "routing: {model: m, metrics_auth: false}\nengines:\n  - {url: 'http://127.0.0.1:1', max_model_len: 1024}\n",
        "a prompt between the two fits no main engine"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(WARNINGS))
def test_build_warns_of_routing_settings_that_cannot_work(tmp_path, case: str) -> None:
    text, warning = WARNINGS[case]
    (tmp_path / "batchlens.yaml").write_text(text)
    done = subprocess.run([BATCHLENS, "build", "--config", str(tmp_path / "batchlens.yaml"), "--root",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("Warning: ")]
    assert len(warnings) == 1 and warning in warnings[0], done.stderr
