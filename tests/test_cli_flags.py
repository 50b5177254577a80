"""``kvstate generate``'s mlx-lm flags (``-m``, ``-p``, ``--prompt -``, ``--system-prompt``,
``--ignore-chat-template``, ``--num-draft-tokens``, ``--version``), every flag checked
before the model loads, and the exits: a user error is one line and exit 2, an unknown
flag prints the command's usage, Ctrl-C exits 130 with what finished printed."""

import io
import json
import sys

import mlx.core as mx
import pytest
from test_cli import SMALL, table

import kvstate as kv
from kvstate import cli


@pytest.fixture
def no_load(monkeypatch):
    """Every check here must run before the model loads: loading fails the test."""

    def refuse(*a, **kw):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(cli, "load", refuse)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seed", "-1"], "--seed must be in [0, 2**64), got -1"),
        (["--seed", str(2**64)], "--seed must be in [0, 2**64)"),
        (["--prompt-len", "4:8"], "--prompt-len shape the workload of a model without a"),
        (["--requests", "3", "-p", "hi"], "--requests shape the workload"),
        (["-m", "tiny", "-p", "hi"], "--model tiny has no tokenizer"),
        (["-m", "tiny", "--system-prompt", "be brief"], "--model tiny has no tokenizer"),
        (["--raw", "--system-prompt", "x"], "--system-prompt goes through the chat template"),
        (["--ignore-chat-template", "--system-prompt", "x"], "--system-prompt goes through"),
        (["-p", "-", "-p", "-"], "given more than once"),
        (["-m", "tiny", "--requests", "0"], "--requests must be >= 1"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    ],
)
def test_flags_are_checked_before_the_model_loads(no_load, argv, message, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("a prompt from a pipe"))
    assert cli.main(["generate", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_an_unknown_flag_prints_the_commands_usage(no_load, capsys):
    assert cli.main(["generate", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvstate generate") and "unrecognized arguments: --bogus" in err


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"kvstate {kv.__version__} (mlx {mx.__version__}, mlx-lm ")


def test_prompt_dash_reads_standard_input():
    args = cli.parse(["generate", "-p", "first", "-p", "-", "--num-draft-tokens", "3"])
    cli._check_generate(args, stdin=io.StringIO("  from the pipe\n"))
    assert args.prompt == ["first", "from the pipe"] and args.num_draft == 3
    args = cli.parse(["generate", "-p", "-"])
    with pytest.raises(SystemExit, match="standard input is empty"):
        cli._check_generate(args, stdin=io.StringIO("\n"))


def test_a_system_prompt_goes_before_each_text_prompt(smollm):
    tokenizer = smollm.tokenizer
    args = cli.parse(["generate", "-p", "Hi", "--system-prompt", "Answer in French."])
    cli._check_generate(args)
    (req,) = cli.text_requests(args, tokenizer)
    want = tokenizer.chat(
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    )
    assert req.prompt == tuple(want) and "Answer in French." in tokenizer.decode(want)


def test_ctrl_c_exits_130_with_what_finished_printed(monkeypatch, capsys):
    shown = []
    real = cli.show_completion

    def show_then_interrupt(c, *a, **kw):
        real(c, *a, **kw)
        shown.append(c)
        if len(shown) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(cli, "show_completion", show_then_interrupt)
    assert cli.main(["generate", "--json", "--quiet", *SMALL]) == 130
    cap = capsys.readouterr()
    printed = [json.loads(line) for line in cap.out.splitlines()]
    assert [p["token_ids"] for p in printed] == [list(c.tokens) for c in shown]
    assert len(printed) == 2 and "interrupted" in cap.err and "Traceback" not in cap.err


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_on_a_terminal_counts_requests_and_clears_before_answers():
    out, err = io.StringIO(), Terminal()
    assert cli.generate(cli.parse(["generate", *SMALL]), out=out, err=err) == 0
    drawn = err.getvalue()
    assert drawn.startswith("kvstate: loading tiny") and "\r" in drawn and "| 5/5 [" in drawn
    assert out.getvalue().count("tokens,") == 5  # each answer on its own lines


def test_no_progress_where_stderr_is_not_a_terminal():
    out, err = io.StringIO(), io.StringIO()
    assert cli.generate(cli.parse(["generate", *SMALL]), out=out, err=err) == 0
    assert "\r" not in err.getvalue() and "5/5" not in err.getvalue()


# --- kvstate cache-prompt, then generate --prompt-cache-file ------------------------------

DOCUMENT = (
    "The Voyage of the Clipper Meridian. In the spring of 1851 the clipper Meridian left "
    "Boston for San Francisco with a cargo of rope, nails and flour. The first mate, a quiet "
    "man named Jonah Reed, kept the log. Off Cape Horn the ship met a gale that lasted eleven "
    "days. On the ninety-eighth day the Meridian passed through the Golden Gate."
)


@pytest.mark.slow
def test_a_cached_document_is_prefilled_once_and_answers_equal_mlx_lms(tmp_path, capsys):
    path = tmp_path / "doc.safetensors"
    argv = ["cache-prompt", "--float32", "-p", DOCUMENT, "--prompt-cache-file", str(path)]
    assert cli.main(argv) == 0
    assert "tokens prefilled" in capsys.readouterr().err and path.is_file()
    questions = ["\nWho kept the log?", "\nHow long did the gale last?"]
    argv = ["generate", "--float32", "--json", "--quiet", "--compare", "--max-tokens", "12"]
    argv += ["--prompt-cache-file", str(path)] + [a for q in questions for a in ("-p", q)]
    assert cli.main(argv) == 0
    cap = capsys.readouterr()
    assert "token parity: 2/2 requests identical" in cap.err  # mlx-lm prefills it all
    ours = table(cap.err)["kvstate"]
    prompt, saved = int(ours["prompt tok"]), int(ours["saved"])
    args = cli.parse(["generate", "-p", "x"])
    from kvstate.models import load as models

    tokenizer = models.load_model(None, dequantize=True).tokenizer
    doc = cli.document_ids(args, tokenizer, DOCUMENT)
    # each prompt is the document's tokens, then the rest of the user turn: the question,
    # the turn's end and the assistant's turn opened, as mlx_lm.generate cuts it
    for q in questions:
        full = tokenizer.render([{"role": "user", "content": DOCUMENT + q}])
        assert tokenizer.decode(doc + cli._continued(args, tokenizer, q)) == tokenizer.decode(
            tokenizer.encode(full)
        )
    assert saved >= 2 * (len(doc) - 1) and prompt > saved  # only the questions prefilled


def test_a_prompt_cache_file_of_another_model_is_refused(tmp_path, capsys, monkeypatch):
    from kvstate.serving.prefix_cache import PrefixCache

    path = tmp_path / "other.safetensors"
    other = PrefixCache(1 << 20, identity="another model")
    k = mx.zeros((1, 1, 3, 4))
    other.insert([1, 2, 3], [kv.append(kv.empty(1), k, k)])
    other.save(path)
    monkeypatch.setattr(cli, "_identity", lambda args, err: "this model")
    start = cli.parse(["generate", "-p", "q", "--prompt-cache-file", str(path)])
    with pytest.raises(kv.KVStateError, match="a prefix cache for this model"):
        cli._start_cache(start, None)


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "no such file"),
        (["--compile"], "drop --compile"),
        (["--no-prefix-cache"], "drop --no-prefix-cache"),
        (["--draft", "ngram"], "drop --draft"),
    ],
)
def test_prompt_cache_file_flags_are_checked_before_the_model_loads(
    no_load, tmp_path, capsys, extra, message
):
    path = tmp_path / "doc.safetensors"
    if extra:
        path.write_bytes(b"")
    argv = ["generate", "--quiet", "-p", "q", "--prompt-cache-file", str(path), *extra]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
