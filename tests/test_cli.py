"""The ``kvstate`` command: ``python -m kvstate generate`` end to end, the
continuous-batching scheduler, ``--model`` on a local directory, ``--compare``
parity (and that a mismatch is reported), and bad arguments."""

import dataclasses
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
import tiny_models as tm

from kvstate import cli

SMALL = [
    "--model",
    "tiny",
    "--requests",
    "5",
    "--prompt-len",
    "3:12",
    "--gen-len",
    "2:9",
    "--batch-size",
    "3",
    "--arrival-gap",
    "1",
]


def table(stdout):
    """``{engine: {column: value}}`` from the printed table (columns two spaces apart
    at least; a value or a name has single spaces only)."""
    lines = stdout.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("engine"))
    head = re.split(r"\s{2,}", lines[i].strip())
    assert head == [name for name, _ in cli.COLUMNS]
    rows = {}
    for line in lines[i + 1 :]:
        if not line.startswith(("kvstate", "mlx-lm")):
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = dict(zip(head, cells))
    return rows


def expected_tokens(argv_seed=0):
    reqs = cli.make_requests(5, (3, 12), (2, 9), 1, 512, argv_seed)
    return sum(len(r.prompt) for r in reqs), sum(r.max_tokens for r in reqs)


def test_python_m_kvstate_generate_compare():
    proc = subprocess.run(
        [sys.executable, "-m", "kvstate", "generate", "--compare", *SMALL],
        capture_output=True,
        timeout=120,
    )
    stdout, stderr = proc.stdout.decode(), proc.stderr.decode()  # bytes: keep the \r
    assert proc.returncode == 0, stderr
    rows = table(stdout)
    prompt, gen = expected_tokens()
    for name in ("kvstate", "mlx-lm"):
        r = rows[name]
        assert int(r["requests"]) == 5
        assert int(r["prompt tok"]) == prompt and int(r["gen tok"]) == gen
        assert float(r["time s"]) > 0
        assert float(r["prompt tok/s"].replace(",", "")) > 0
        assert float(r["gen tok/s"].replace(",", "")) > 0
        assert float(r["peak MB"].replace(",", "")) > 0
        held, reserved = (int(r[c].replace(",", "")) for c in ("held B/tok", "reserved B/tok"))
        assert 0 < held <= reserved  # padding and spare capacity are reserved, not held
    for name, _ in cli.COLUMNS:  # every column explained under the table
        assert f"  {name}  " in stdout
    assert "token parity: 5/5 requests identical" in stdout
    assert "speed ratio (mlx-lm time / kvstate time):" in stdout
    assert "\r" not in stderr  # no progress redraws where stderr is not a terminal


def test_json_lines_have_the_documented_fields(capsys):
    """Each ``--json`` line has the fields of ``cli.JSON_FIELDS`` in its order, ``error``
    only on a failed request; ``generate --help`` and notes/cli.md explain each field
    with that one legend's words."""
    names = [name for name, _ in cli.JSON_FIELDS]
    rows, _ = run_json(SMALL, capsys)
    assert len(rows) == 5
    for row in rows:
        assert list(row) == [n for n in names if n != "error"]
        assert row["generated_tokens"] == len(row["token_ids"]) > 0
        assert row["prompt"] is None and row["completion"] is None  # random ids, no tokenizer
    failed = cli.Completion(cli.Request(3, (1, 2), 4), (5,), "error", 0.5, 0.75, "a fault")
    out = io.StringIO()
    cli.show_completion(failed, None, out, as_json=True)
    row = json.loads(out.getvalue())
    assert list(row) == names and row["error"] == "a fault" and row["finish_reason"] == "error"
    assert cli.main(["generate", "--help"]) == 0
    helped = " ".join(capsys.readouterr().out.split())
    note = " ".join((Path(cli.__file__).parents[1] / "notes" / "cli.md").read_text().split())
    for name, what in cli.JSON_FIELDS:
        assert f"{name} {what}" in helped
        assert f"`{name}`: {what}" in note


def test_rows_join_and_leave_mid_generation():
    """The one scheduler admits rows into a running batch and drops finished rows
    while the others go on (the active row count after every step shows both);
    mlx-lm's BatchGenerator on the same requests gives the same tokens."""
    model = cli.tiny_llama(0, layers=2, hidden=64, heads=4, kv_heads=2, vocab=128)
    reqs = cli.make_requests(8, (2, 10), (2, 12), 1, 128, seed=3)
    active: list = []
    done, stats = cli.serve(
        cli.KVStateEngine(model), reqs, batch_size=4, progress=lambda t, a, q: active.append(a)
    )
    assert [len(c.tokens) for c in done] == [r.max_tokens for r in reqs]
    assert [c.request for c in done] == reqs
    assert max(active) == 4  # the batch filled up
    assert any(0 < a < b for a, b in zip(active, active[1:]))  # joined a running batch
    assert any(0 < b < a for a, b in zip(active, active[1:]))  # left while others go on
    assert stats["steps"] > 0 and stats["bytes_per_token"] > 0
    ref, _ = cli.serve(cli.MlxLmEngine(model), reqs, batch_size=4)
    assert [c.tokens for c in ref] == [c.tokens for c in done]


@pytest.mark.parametrize(
    "build",
    [
        lambda: cli.tiny_llama(5, layers=2, hidden=64, heads=4, kv_heads=2, vocab=128),
        lambda: tm.gemma3_model(seed=2, layers=4, sliding_window=8),  # ring layers
    ],
    ids=["llama", "gemma3-sliding"],
)
def test_local_model_directory(build, tmp_path, capsys):
    model = build()
    model.save_weights(str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(model.args)))
    argv = ["generate", "--model", str(tmp_path), "--compare", "--quiet", *SMALL[2:]]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"model: {tmp_path}" in out and "token parity: 5/5 requests identical" in out


def test_a_token_mismatch_is_reported(monkeypatch, capsys):
    def off_by_one(self, logprobs):
        return mx.argmax(logprobs[:, ::-1], axis=-1)  # the argmax lands elsewhere

    monkeypatch.setattr(cli.MlxLmEngine, "sample", off_by_one)
    assert cli.main(["generate", "--compare", "--quiet", *SMALL]) == 1
    assert "(MISMATCH)" in capsys.readouterr().out


def test_compile_flag(capsys):
    argv = ["generate", "--compile", "--compare", "--quiet", *SMALL]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "kvstate (compiled)" in out and "token parity: 5/5 requests identical" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--prompt-len", "5:2"], "LO:HI"),
        (["--model", "/nonexistent/model"], "no config.json"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    assert cli.main(["generate", "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err


# --- the real model (SmolLM2-135M-Instruct, fetched and cached as the first run does) ----


def run_json(argv, capsys):
    assert cli.main(["generate", "--json", "--quiet", *argv]) == 0
    cap = capsys.readouterr()
    return [json.loads(line) for line in cap.out.splitlines()], cap.err


@pytest.mark.slow
def test_default_model_answers_a_chat_prompt(capsys):
    rows, err = run_json(
        ["--prompt", "What is the capital of France?", "--max-tokens", "12"], capsys
    )
    (row,) = rows
    assert row["completion"] == "The capital of France is Paris."
    assert row["finish_reason"] == "stop" and row["token_ids"][-1] == 2  # <|im_end|>
    assert row["generated_tokens"] == len(row["token_ids"]) <= 12
    assert row["prompt"] == "What is the capital of France?" and row["prompt_tokens"] > 30
    assert row["ttft_s"] > 0
    assert "SmolLM2-135M-Instruct" in err and "prompt tok" in err  # the table, on stderr


@pytest.mark.slow
def test_compare_on_the_real_model(capsys):
    argv = [
        "generate",
        "--raw",
        "--float32",
        "--prompt",
        "The capital of France is",
        "--prompt",
        "Hi",
        "--prompt",
        "1 2 3 4 5 6",
        "--max-tokens",
        "3",
        "--compare",
        "--quiet",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "token parity: 3/3 requests identical" in out
    assert "[0] The capital of France is" in out  # each completion printed


@pytest.mark.slow
def test_prompts_file_and_sampling(tmp_path, capsys):
    f = tmp_path / "prompts.jsonl"
    f.write_text(
        "The sky is\n"
        '{"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0.9, '
        '"seed": 5}\n\n'
        '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}\n'
    )
    argv = [
        "--prompts",
        str(f),
        "--raw",
        "--max-tokens",
        "4",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--float32",
    ]
    first, _ = run_json(argv, capsys)
    again, _ = run_json(argv, capsys)
    by_id = {r["id"]: r for r in first}
    assert sorted(by_id) == [0, 1, 2]
    assert [by_id[i]["generated_tokens"] for i in (0, 1, 2)] == [4, 2, 1]
    assert by_id[1]["prompt"] == "Once upon a time"
    assert {r["id"]: r["token_ids"] for r in again} == {
        i: r["token_ids"] for i, r in by_id.items()
    }  # seeded


def test_built_in_prompts_go_through_the_chat_template():
    from kvstate.models import load as models

    tok = models.load_model(None).tokenizer
    args = cli._parser().parse_args(["generate"])
    reqs = cli.text_requests(args, tok)
    assert [r.text for r in reqs] == list(cli.PROMPTS) + [c[-1]["content"] for c in cli.CHATS]
    for r in reqs:
        assert tok.decode(r.prompt).endswith(f"user\n{r.text}\nassistant\n")
        assert r.max_tokens == 48 and r.temperature == 0 and r.stop == tok.eos_ids
    assert len({r.seed for r in reqs}) == len(reqs)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "x", "--model", "tiny"], "has no tokenizer"),
        (["--temperature", "-1"], "--temperature"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    ],
)
def test_bad_real_model_arguments(argv, message, capsys):
    assert cli.main(["generate", "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err
