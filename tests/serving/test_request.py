# ruff: noqa: E501  (message literals kept on one line each: the table reads as one row per case)
"""The request surface of `kvstate serve`, through the real `openai` client: messages of
every role, list prompts, each sampling field against mlx-lm's own sampler and
processors, log-probabilities against the model's logits, refused fields, JSON 404s."""

import json
import urllib.error
import urllib.request

import attrs
import mlx.core as mx
import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the serve tests call the server with openai")
pytest.importorskip("aiohttp", reason="kvstate serve runs on aiohttp")

from _server import Server, messages  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.sample_utils import make_logits_processors, make_sampler  # noqa: E402

from kvstate.serving import request  # noqa: E402
from kvstate.serving.http import model_id  # noqa: E402
from kvstate.serving.scheduler import Job, Scheduler  # noqa: E402

Q = "Name three fruits."
REPEAT = "Write the word banana five times."
TOKENS = 12


@pytest.fixture(scope="module")
def server(smollm):
    s = Server(smollm, max_batch=8)
    yield s
    s.close()


def _chat(server, **kw):
    kw.setdefault("max_tokens", TOKENS)
    kw.setdefault("temperature", 0)
    kw.setdefault("messages", messages(Q))
    return server.client().chat.completions.create(model="x", **kw)


def _mlx_lm(smollm, prompt, n=TOKENS, sampler=None, **processors):
    """What mlx-lm's generate_step answers with its own sampler and processors (up to eos)."""
    procs = make_logits_processors(**processors) if processors else None
    out = []
    for (token, _), _ in zip(
        generate_step(mx.array(prompt), smollm.model, sampler=sampler, logits_processors=procs),
        range(n),
    ):
        token = int(token)
        out.append(token)
        if token in smollm.tokenizer.eos_ids:
            break
    return smollm.tokenizer.decode(out)


# --- messages -------------------------------------------------------------------------

TOOL_MESSAGES = [
    {"role": "developer", "content": [{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Answer."}]},
    {"role": "user", "content": "What is f(1)?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "42"},
]  # fmt: skip
# What SmolLM2's template is given: its template names neither developer nor tool_calls.
RENDERED = [
    {"role": "system", "content": "Be brief. Answer."},
    {"role": "user", "content": "What is f(1)?"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'},
    {"role": "tool", "content": "42"},
]  # fmt: skip


def test_roles_parts_and_tool_messages_reach_the_template(server, smollm):
    tok = smollm.tokenizer
    text = tok.render(RENDERED)
    assert "<|im_start|>system\nBe brief. Answer.<|im_end|>" in text
    assert "<|im_start|>tool\n42<|im_end|>" in text and '"arguments": {"a": 1}' in text
    assert "You are a helpful AI assistant named SmolLM" not in text  # developer is the system
    client = server.client()
    r = client.chat.completions.create(
        model="x", messages=TOOL_MESSAGES, max_tokens=TOKENS, temperature=0
    )
    assert r.usage.prompt_tokens == len(tok.chat(RENDERED))
    same = client.completions.create(
        model="x", prompt=tok.chat(RENDERED), max_tokens=TOKENS, temperature=0
    )
    assert r.choices[0].message.content == same.choices[0].text


def test_a_template_that_knows_developer_and_tool_calls_gets_them(smollm):
    tok = attrs.evolve(smollm.tokenizer, template="{{ m.tool_calls }} developer")
    got = tok.for_template(request.messages_of({"messages": TOOL_MESSAGES}))
    assert got[0]["role"] == "developer"
    assert got[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert got[3]["tool_call_id"] == "c1"


@pytest.mark.parametrize(
    "message, param, says",
    [
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "messages[0].content",
            "image_url",
        ),
        ({"role": "user", "content": None}, "messages[0].content", "text parts"),
        ({"role": "tool", "content": "42"}, "messages[0].tool_call_id", "tool_call_id"),
        ({"role": "user", "content": "hi", "tool_call_id": "c"}, "messages[0]", "tool_call_id"),
        (
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "[1"}}]},
            "messages[0].tool_calls[0].function.arguments",
            "JSON object",
        ),
    ],
)  # fmt: skip
def test_bad_messages_are_a_400_naming_the_part(server, message, param, says):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model="x", messages=[message], max_tokens=1)
    assert e.value.body["param"] == param and says in e.value.body["message"]


# --- list prompts ---------------------------------------------------------------------


def test_a_list_of_prompts_gives_one_choice_per_prompt_and_choice(server, smollm):
    tok = smollm.tokenizer
    prompts = ["The capital of France is", tok.encode("One, two, three,"), "Water boils at"]
    client = server.client()
    alone = [
        client.completions.create(model="x", prompt=p, max_tokens=8, temperature=0).choices[0].text
        for p in prompts
    ]
    r = client.completions.create(model="x", prompt=prompts, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [
        a for a in alone for _ in range(2)
    ]
    assert r.usage.prompt_tokens == sum(
        len(p if isinstance(p, list) else tok.encode(p)) for p in prompts
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="x", prompt=[[1, 2, 10**9]], max_tokens=1)
    assert e.value.body["param"] == "prompt" and "vocabulary" in e.value.body["message"]


# --- sampling fields, against mlx-lm ------------------------------------------------------


@pytest.mark.parametrize(
    "fields, processors",
    [
        ({"presence_penalty": 2.0}, {"presence_penalty": 2.0}),
        ({"frequency_penalty": 2.0}, {"frequency_penalty": 2.0}),
        (
            {"extra_body": {"repetition_penalty": 2.0, "repetition_context_size": 50}},
            {"repetition_penalty": 2.0, "repetition_context_size": 50},
        ),
        ({"logit_bias": {"28": 8.0, "30": 9.0}}, {"logit_bias": {28: 8.0, 30: 9.0}}),
    ],
)
def test_each_processor_changes_the_reply_as_mlx_lms_does(server, smollm, fields, processors):
    prompt = smollm.tokenizer.chat(messages(REPEAT))
    plain = _chat(server, messages=messages(REPEAT)).choices[0].message.content
    got = _chat(server, messages=messages(REPEAT), **fields).choices[0].message.content
    assert got == _mlx_lm(smollm, prompt, **processors)
    assert got != plain  # the control: the field does something here


def test_top_k_one_and_min_p_one_at_any_temperature_are_greedy(server, smollm):
    prompt = smollm.tokenizer.chat(messages(Q))
    greedy = _mlx_lm(smollm, prompt)
    assert _mlx_lm(smollm, prompt, sampler=make_sampler(1.5, top_k=1)) == greedy
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        r = _chat(server, temperature=1.5, seed=3, extra_body=extra)
        assert r.choices[0].message.content == greedy
    hot = {_chat(server, temperature=1.5, seed=s).choices[0].message.content for s in range(3)}
    assert hot != {greedy}  # the control: at 1.5 unfiltered, the replies are not greedy


def test_seed_repeats_and_stop_token_ids_end_a_choice(server, smollm):
    a, b = (_chat(server, temperature=1.0, seed=11).choices[0].message.content for _ in range(2))
    assert a == b
    plain = _chat(server)
    first = smollm.tokenizer.encode(plain.choices[0].message.content)[2]
    r = _chat(server, extra_body={"stop_token_ids": [first]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 3


# --- log-probabilities ------------------------------------------------------------------


def _reference_logprobs(smollm, prompt, steps):
    """Greedy steps by full forwards (no cache): per step (token, log_softmax row)."""
    ids, out = list(prompt), []
    for _ in range(steps):
        logits = smollm.model(mx.array([ids]))[0, -1].astype(mx.float32)
        lp = np.array(logits - mx.logsumexp(logits))
        t = int(lp.argmax())
        out.append((t, lp))
        ids.append(t)
    return out


def _check_entries(entries, ref, tok, top):
    assert len(entries) == len(ref)
    for e, (t, lp) in zip(entries, ref):
        assert e["token"] == tok.decode([t])
        assert e["logprob"] == pytest.approx(float(lp[t]), abs=2e-3)
        best = np.argsort(-lp)[:top]
        assert [x["token"] for x in e["top_logprobs"]] == [tok.decode([int(u)]) for u in best]
        assert [x["logprob"] for x in e["top_logprobs"]] == pytest.approx(lp[best], abs=2e-3)
        assert e["top_logprobs"][0]["logprob"] == e["logprob"]  # greedy: rank 1


def test_chat_logprobs_are_the_models_log_softmax_streamed_too(server, smollm):
    tok, n = smollm.tokenizer, 6
    ref = _reference_logprobs(smollm, tok.chat(messages(Q)), n)
    r = _chat(server, max_tokens=n, logprobs=True, top_logprobs=5)
    entries = [e.model_dump() for e in r.choices[0].logprobs.content]
    _check_entries(entries, ref, tok, 5)
    assert entries[0]["bytes"] == list(entries[0]["token"].encode())
    stream = _chat(server, max_tokens=n, logprobs=True, top_logprobs=5, stream=True)
    streamed = [
        e.model_dump() for c in stream if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]  # fmt: skip
    _check_entries(streamed, ref, tok, 5)
    assert _chat(server, max_tokens=2).choices[0].logprobs is None


def test_completion_logprobs_have_the_legacy_shape(server, smollm):
    tok, n = smollm.tokenizer, 5
    prompt = tok.encode("The capital of France is")
    ref = _reference_logprobs(smollm, prompt, n)
    r = server.client().completions.create(
        model="x", prompt=prompt, max_tokens=n, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t, _ in ref]
    assert lp.token_logprobs == pytest.approx([float(x[t]) for t, x in ref], abs=2e-3)
    assert [list(d) for d in lp.top_logprobs] == [
        [tok.decode([int(u)]) for u in np.argsort(-x)[:3]] for _, x in ref
    ]
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(n)]


# --- rows of different settings in one batch ------------------------------------------------

SETTINGS = [
    {},
    {"sampling": {"presence_penalty": 1.5}, "logprobs": 3},
    {"temperature": 1.0, "seed": 5, "sampling": {"top_k": 5}},
    {
        "temperature": 0.8,
        "seed": 9,
        "sampling": {"min_p": 0.1, "repetition_penalty": 1.3, "logit_bias": ((28, 4.0),)},
        "logprobs": 0,
    },
    {"sampling": {"frequency_penalty": 1.0, "context_size": 5}, "n": 2},
]


def _run(smollm, settings):
    """Every job of ``settings`` submitted to one scheduler before it steps (so they are
    admitted together, one batch); per job and choice, its tokens and log-probabilities."""
    sched = Scheduler(smollm.model, smollm.tokenizer.eos_ids, max_batch=8)
    prompt = smollm.tokenizer.chat(messages(Q))
    got = []
    for s in settings:
        out: dict = {}
        got.append(out)
        job = Job(
            prompt=prompt,
            max_tokens=TOKENS,
            emit=lambda kind, i, v, out=out: out.setdefault((kind, i), []).append(v),
            **s,
        )
        sched.submit(job)
    while sched.step():
        pass
    return got


def test_rows_of_different_settings_batched_each_equal_the_row_alone(smollm):
    together = _run(smollm, SETTINGS)
    for s, got in zip(SETTINGS, together):
        (alone,) = _run(smollm, [s])
        assert got.keys() == alone.keys()
        for key in got:
            if key[0] == "logprob":
                for (a, top_a), (b, top_b) in zip(got[key], alone[key]):
                    assert a == pytest.approx(b, abs=1e-3)
                    assert [u for u, _ in top_a] == [u for u, _ in top_b]
            else:
                assert got[key] == alone[key], (s, key)
    assert together[0] != together[1]  # the control: the settings change the tokens


# --- fields: implemented, metadata, refused ---------------------------------------------------

REFUSED = sorted(request.REFUSED)


@pytest.mark.parametrize("field", REFUSED + ["no_such_field"])
def test_each_field_not_implemented_is_a_400_naming_it(server, field):
    for kind in ("chat", "completions"):
        client = server.client()
        with pytest.raises(openai.BadRequestError) as e:
            if kind == "chat":
                _chat(server, max_tokens=1, extra_body={field: {"x": 1}})
            else:
                client.completions.create(
                    model="x", prompt="hi", max_tokens=1, extra_body={field: {"x": 1}}
                )
        assert e.value.body["param"] == field and field in e.value.body["message"]


def test_metadata_and_harmless_values_are_accepted(server):
    r = _chat(
        server,
        max_tokens=1,
        user="u-1",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        extra_body={"safety_identifier": "s", "prompt_cache_key": "p"},
    )
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server, max_tokens=1, user=3)
    assert e.value.body["param"] == "user"


def test_logprob_fields_are_checked(server):
    for extra, param in (
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(server, max_tokens=1, extra_body=extra)
        assert e.value.body["param"] == param  # fmt: skip
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server, max_tokens=1, logit_bias={"a": 1})
    assert e.value.body["param"] == "logit_bias"


# --- paths ------------------------------------------------------------------------------------


def _get(url):
    try:
        with urllib.request.urlopen(url) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_by_id_and_unknown_paths_answer_json(server, smollm):
    served = model_id(smollm.name)
    assert " " not in served and served == server.client().models.list().data[0].id
    for name in (served, smollm.name.replace(" ", "%20")):
        status, body = _get(f"{server.url}/v1/models/{name}")
        assert status == 200 and body["id"] == served
    status, body = _get(f"{server.url}/v1/models/gpt-4")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = _get(f"{server.url}/v1/nowhere")
    assert status == 404 and "/v1/nowhere" in body["error"]["message"]
    status, body = _get(f"{server.url}/v1/chat/completions")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
