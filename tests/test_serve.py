"""serve.py through what its users point at it: the openai client, lm-evaluation-harness, a browser, curl-like
raw HTTP (bad requests, streams that hang up), and SIGTERM. The server runs on 127.0.0.1 at a free port, in
this process (uvicorn in a thread) except where the process boundary is the point (SIGTERM); the model is a
small random character-level checkpoint, run in float32 so that the expected values computed here, with the
model's plain forward, are exact to float32 rounding."""

import asyncio
import contextlib
import json
import os
import signal
import threading
import time

import httpx
import httpx2
import pytest
import torch
import torch.nn.functional as F
import uvicorn
from openai import DefaultHttpx2Client, OpenAI

import sample
import serve
from conftest import TAUGHT, free_port, kill_tree, make_corpus, run_in_process, runs, script_zygote, wait_for_line
from machinery import configurator
from machinery.data import chat
from machinery.generation import engine
from machinery.serving import openai_api, openai_responses
from machinery.weights import checkpoint
from machinery.data.meta import DatasetMeta
from machinery.data.tokenizer import CharTokenizer
from model import GPT, GPTConfig
from train import TrainConfig

NAME = "tiny"  # the served model's name: its out_dir's last part
TOL = 1e-5  # log-probabilities: oneDNN's prepacked products against PyTorch's, both float32 (sums of ~100 terms)


@pytest.fixture(scope="module", autouse=True)
def script_zygote_started_early(request, zygotes):
    """The Python that test_sigterm_ends_open_streams_cleanly_and_exits_0 forks serve.py from (conftest's
    start_script), started as this module begins, if that test is to run: its imports go on while the tests
    before it run."""
    if runs(request, "test_sigterm_ends_open_streams_cleanly_and_exits_0"):
        script_zygote(zygotes)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    """out_dir/best.pt of a random character-level model (block 64) over make_corpus()'s characters."""
    tokenizer = CharTokenizer(sorted(set(make_corpus())))
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2, n_embd=32))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)  # larger than GPT-2's init: varied text
    out = tmp_path_factory.mktemp("serve") / NAME
    out.mkdir()
    state = checkpoint.training_state(model.state_dict(), model.config, TrainConfig(), DatasetMeta.of(tokenizer),
                                      iter_num=0, best_val_loss=float("inf"))
    checkpoint.save(state, str(out / checkpoint.BEST))
    return out



@pytest.fixture(scope="module")
def bpe_ckpt_dir(tmp_path_factory):
    """out_dir/best.pt of a tiny random GPT-2 BPE model (GPT-2's padded vocabulary, block 32)."""
    torch.manual_seed(1)
    model = GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=16))
    out = tmp_path_factory.mktemp("serve-bpe") / "bpe"
    out.mkdir()
    state = checkpoint.training_state(model.state_dict(), model.config, TrainConfig(), DatasetMeta.gpt2(),
                                      iter_num=0, best_val_loss=float("inf"))
    checkpoint.save(state, str(out / checkpoint.BEST))
    return out


@contextlib.contextmanager
def serving(ckpt_dir, *settings, device="cpu"):
    """serve.py's server (its build() and app, and its connections' bounded buffers: serve.bounded_http) on
    127.0.0.1 at a free port, in a thread of this process."""
    import socket

    port = free_port()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    cfg = configurator.parse(serve.ServeConfig, [f"--out_dir={ckpt_dir}", f"--device={device}", "--dtype=float32",
                                                 f"--port={port}", *settings])
    cfg.validate()
    server, _ = serve.build(cfg)
    http = uvicorn.Server(uvicorn.Config(openai_api.create_app(server), host="127.0.0.1", port=port,
                                         http=serve.bounded_http(), log_level="warning"))
    server.engine.start()
    thread = threading.Thread(target=http.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not http.started and time.time() < deadline:
        time.sleep(0.02)
    assert http.started
    server.url = f"http://127.0.0.1:{port}"
    try:
        yield server
    finally:
        http.should_exit = True
        server.engine.stop()
        thread.join(timeout=30)
        listener.close()


@pytest.fixture(scope="module")
def server(ckpt_dir):
    with serving(ckpt_dir, "--max_tokens=100000") as s:
        yield s


# one client each for the module's plain HTTP requests and the openai clients' (a new one per request costs ~20 ms
# of loading certificates that http://127.0.0.1 never uses); no connection is kept alive between requests
HTTP = httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0))
OPENAI_HTTP = DefaultHttpx2Client(limits=httpx2.Limits(max_keepalive_connections=0))


def client(server, **kw):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60, http_client=OPENAI_HTTP,
                  **kw)


def reference_logprobs(ckpt_dir, ids):
    """log_softmax of the model's plain float32 forward (no cache, no engine) at every position of ids."""
    model = checkpoint.load(str(ckpt_dir / checkpoint.BEST)).build_model().eval()
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]), torch.tensor([ids]))  # with targets: every position's logits
    return F.log_softmax(logits[0].double(), dim=-1)


# ---------------------------------------------------------------------- through the openai client


def test_greedy_completion_equals_sample_py(server, ckpt_dir):
    answer = client(server).completions.create(model=NAME, prompt="ROMEO:", max_tokens=40, temperature=0)
    printed = run_in_process(sample.main, f"--out_dir={ckpt_dir}", "--device=cpu", "--dtype=float32",
                             "--start=ROMEO:", "--max_new_tokens=40", "--temperature=0", "--num_samples=1",
                             check=True).stdout
    assert printed == "ROMEO:" + answer.choices[0].text + "\n---------------\n"
    assert answer.model == NAME and answer.object == "text_completion"
    assert answer.choices[0].finish_reason == "length" and len(answer.choices[0].text) == 40  # one char a token
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (6, 40, 46)


def test_a_prompt_longer_than_block_size_is_refused_and_generation_past_it_slides_as_in_sample_py(server, ckpt_dir):
    full = make_corpus()[:64]  # block_size characters: the whole context; every new token slides the window
    answer = client(server).completions.create(model=NAME, prompt=full, max_tokens=20, temperature=0)
    printed = run_in_process(sample.main, f"--out_dir={ckpt_dir}", "--device=cpu", "--dtype=float32",
                             f"--start={full}", "--max_new_tokens=20", "--temperature=0", "--num_samples=1",
                             check=True)
    assert printed.stdout == full + answer.choices[0].text + "\n---------------\n"
    assert answer.usage.prompt_tokens == 64 and answer.usage.completion_tokens == 20
    # one token more, scored with echo and logprobs as lm-evaluation-harness asks: cutting it would change every
    # log-likelihood, so it is refused as OpenAI and vLLM refuse it, with both numbers
    longer = server.tokenizer.encode(make_corpus()[:65])
    r = HTTP.post(f"{server.url}/v1/completions", timeout=30,
                   json={"prompt": longer, "echo": True, "logprobs": 1, "max_tokens": 1})
    error = r.json()["error"]
    assert r.status_code == 400 and (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    assert "64" in error["message"] and "65" in error["message"]
    assert HTTP.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["max_model_len"] == 64


def test_n_choices_draw_with_seed_plus_i_and_usage_comes_last_when_asked(server):
    together = client(server).completions.create(model=NAME, prompt=["KING", "LADY"], n=2, max_tokens=8,
                                                  seed=10, temperature=1.0)
    assert [c.index for c in together.choices] == [0, 1, 2, 3]
    for i, (prompt, seed) in enumerate([("KING", 10), ("KING", 11), ("LADY", 10), ("LADY", 11)]):
        alone = client(server).completions.create(model=NAME, prompt=prompt, max_tokens=8, seed=seed,
                                                  temperature=1.0)
        assert together.choices[i].text == alone.choices[0].text
    assert together.usage.completion_tokens == 4 * 8 and together.usage.prompt_tokens == 4 * 4
    chunks = list(client(server).completions.create(model=NAME, prompt="KING", max_tokens=5, stream=True,
                                                    stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_serve_py_mistakes_are_one_line_errors(ckpt_dir, monkeypatch):
    from conftest import assert_one_error_line

    assert_one_error_line(run_in_process(serve.main, f"--out_dir={ckpt_dir}", "--port=0"), "port")
    assert_one_error_line(run_in_process(serve.main, f"--out_dir={ckpt_dir}", "--max_batch=0"), "max_batch")
    real_import = __builtins__["__import__"] if isinstance(__builtins__, dict) else __builtins__.__import__

    def without_uvicorn(name, *args, **kwargs):
        if name == "uvicorn":
            raise ImportError("No module named 'uvicorn'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr("builtins.__import__", without_uvicorn)
    assert_one_error_line(run_in_process(serve.main, f"--out_dir={ckpt_dir}"),
                          "pip install fastapi==0.165.0 uvicorn==0.54.0")


def test_streamed_chunks_join_to_the_whole_text_and_the_raw_stream_ends_with_done(server):
    args = dict(model=NAME, prompt="JULIET:", max_tokens=30, temperature=0.9, top_k=20, seed=7)
    whole = client(server).completions.create(**{k: v for k, v in args.items() if k != "top_k"},
                                              extra_body={"top_k": 20}).choices[0]
    chunks = list(client(server).completions.create(stream=True, **{k: v for k, v in args.items() if k != "top_k"},
                                                    extra_body={"top_k": 20}))
    assert "".join(c.choices[0].text for c in chunks) == whole.text and len(whole.text) == 30
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    with HTTP.stream("POST", f"{server.url}/v1/completions", json=dict(args, stream=True), timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]) == whole.text


def test_echo_and_logprobs_equal_the_log_softmax_of_the_models_forward(server, ckpt_dir):
    tokenizer = server.tokenizer
    prompt = tokenizer.encode("KING HENRY: my lord")  # as token ids, as lm-evaluation-harness sends them
    answer = client(server).completions.create(model=NAME, prompt=prompt, echo=True, logprobs=3, max_tokens=4,
                                               temperature=0)
    choice = answer.choices[0]
    lp = choice.logprobs
    generated = [tokenizer.stoi[c] for c in choice.text[len("KING HENRY: my lord"):]]
    ids = prompt + generated
    assert choice.text == tokenizer.decode(ids) and len(generated) == 4
    assert lp.tokens == [tokenizer.decode([i]) for i in ids]
    assert lp.text_offset == list(range(len(ids)))  # one character per token
    expected = reference_logprobs(ckpt_dir, ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(expected[j - 1, ids[j]].item(), abs=TOL)
        top = torch.topk(expected[j - 1], 3)
        assert list(lp.top_logprobs[j]) == [tokenizer.decode([i]) for i in top.indices.tolist()]
        assert list(lp.top_logprobs[j].values()) == pytest.approx(top.values.tolist(), abs=TOL)
    for j in range(len(prompt), len(ids)):  # greedy: each generated token is its position's most likely
        assert ids[j] == expected[j - 1].argmax().item()


def test_chat_completions_answer_as_the_assistant_streamed_and_not(server):
    messages = [{"role": "system", "content": "A play."}, {"role": "user", "content": "Who art thou?"}]
    answer = client(server).chat.completions.create(model=NAME, messages=messages, max_tokens=12, seed=3)
    message = answer.choices[0].message
    assert answer.object == "chat.completion" and message.role == "assistant" and message.content
    assert answer.usage.prompt_tokens == len("A play.\n\nUser: Who art thou?\nAssistant:")  # the template
    chunks = list(client(server).chat.completions.create(model=NAME, messages=messages, max_tokens=12, seed=3,
                                                         stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason


def test_eight_concurrent_seeded_streams_each_equal_the_same_request_alone(server, monkeypatch):
    requests = [dict(model=NAME, prompt=text, max_tokens=40, temperature=1.0, seed=seed, stream=True)
                for seed, text in enumerate(["ROMEO:", "JULIET: ", "KING", "LADY", "the ", "O", "what", "love"])]
    rows, step = [], engine.Engine.step
    monkeypatch.setattr(engine.Engine, "step", lambda self: rows.append(len(self.rows)) or step(self))

    def streamed(args):
        with HTTP.stream("POST", f"{server.url}/v1/completions", json=args, timeout=60) as r:
            return "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                           if line.startswith("data: {"))

    threads, together = [], [None] * 8
    for i, args in enumerate(requests):
        threads.append(threading.Thread(target=lambda i=i, a=args: together.__setitem__(i, streamed(a))))
        threads[-1].start()
    for t in threads:
        t.join(timeout=60)
    assert max(rows) >= 4  # they did run together
    rows.clear()
    alone = [streamed(args) for args in requests]
    assert max(rows) == 1
    assert together == alone and all(len(t) == 40 for t in alone)


# ---------------------------------------------------------------------- lm-evaluation-harness


def test_lm_evaluation_harness_scores_every_choice_as_transformers_does_on_the_exported_model(server, ckpt_dir,
                                                                                             tmp_path):
    """lm-evaluation-harness's own evaluator, as the README's `lm_eval --model local-completions --model_args
    model=NAME,base_url=.../v1/completions,tokenizer_backend=remote,max_length=64` runs it (in this process, its
    task index limited to the task given: the CLI first indexes its ~10,000 built-in tasks, 7 s), on a local
    multiple-choice task whose contexts are longer than the model's: it tokenizes through /tokenize, cuts each
    context+choice to what max_length (the server's max_model_len) allows, scores through echo and logprobs, and
    every log-likelihood it reports equals transformers' on the model export.py writes, for the same tokens."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import GPT2LMHeadModel

    import export

    long = make_corpus()[:90].replace("\n", " ")
    docs = [{"question": "ROMEO: the king", "choices": ["is good", "was bad", "sleeps"], "answer": 0},
            {"question": long, "choices": ["speak", "love thee", "go"], "answer": 1}]  # > 64 tokens with any choice
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'data.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    max_length = HTTP.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["tiny_mc"], log_samples=True,
        model_args=f"model={NAME},base_url={server.url}/v1/completions,tokenizer_backend=remote,"
                   f"max_length={max_length}",
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False))
    samples = results["samples"]["tiny_mc"]
    assert len(samples) == 2
    run_in_process(export.main, f"--out_dir={ckpt_dir}", str(tmp_path / "hf"), check=True)
    reference = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    encode = server.tokenizer.encode
    for sample_ in samples:
        doc = docs[sample_["doc_id"]]
        for choice, (loglikelihood, greedy) in zip(doc["choices"], sample_["filtered_resps"]):
            continuation = encode(" " + choice)
            # what the harness sends: context + choice cut on the left to max_length - 1 tokens (one more is
            # always generated); the first of them is not scored
            tokens = (encode(doc["question"]) + continuation)[-(max_length - 1):]
            with torch.no_grad():
                logprobs = F.log_softmax(reference(torch.tensor([tokens])).logits[0].double(), dim=-1)
            scored = range(len(tokens) - len(continuation), len(tokens))
            expected = sum(logprobs[j - 1, tokens[j]].item() for j in scored)
            assert float(loglikelihood) == pytest.approx(expected, abs=TOL * len(tokens))
            is_greedy = all(logprobs[j - 1].argmax().item() == tokens[j] for j in scored)
            assert (greedy in (True, "True")) == is_greedy
    assert len(encode(docs[1]["question"] + " go")) > max_length  # the harness did cut it
    assert results["results"]["tiny_mc"]["acc,none"] in (0.0, 0.5, 1.0)


# ---------------------------------------------------------------------- bad requests, limits, hang-ups


BAD = [  # (what is sent (a str or bytes: as it is), status, the error's param, code)
    ("not json", 400, None, "invalid_json"),
    (b'{"prompt": "\xff"}', 400, None, "invalid_json"),  # not UTF-8
    ("[" * 100000 + "]" * 100000, 400, None, "invalid_json"),  # nested deeper than a parser recurses
    ('{"prompt": "a", "temperature": NaN}', 400, None, "invalid_json"),  # (Python's json would read NaN)
    ('{"prompt": "a", "top_p": 1e400}', 400, None, "invalid_json"),  # (and this as infinity)
    ([1, 2], 400, None, "invalid_json"),
    ({"prompt": 5}, 400, "prompt", "invalid_type"),
    ({"prompt": []}, 400, "prompt", "invalid_type"),
    ({"prompt": [1.5, 2]}, 400, "prompt", "invalid_type"),
    ({"prompt": ""}, 400, "prompt", "invalid_value"),  # empty: a character model has no <|endoftext|> to start from
    ({"prompt": [[]]}, 400, "prompt", "invalid_value"),
    ({"prompt": ["a", ""]}, 400, "prompt", "invalid_value"),
    ({"prompt": "a" * 65}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens", "invalid_type"),
    ({"prompt": "a", "max_tokens": 1.5}, 400, "max_tokens", "invalid_type"),
    ({"prompt": "a", "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ({"prompt": "a", "temperature": 3}, 400, "temperature", "invalid_value"),
    ({"prompt": "a", "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ({"prompt": "a", "temperature": True}, 400, "temperature", "invalid_type"),
    ({"prompt": "a", "top_p": 1.5}, 400, "top_p", "invalid_value"),
    ({"prompt": "a", "seed": 1 << 64}, 400, "seed", "invalid_value"),
    ({"prompt": "a", "seed": -(1 << 63) - 1}, 400, "seed", "invalid_value"),
    ({"prompt": "a", "logprobs": 6}, 400, "logprobs", "invalid_value"),
    ({"prompt": "a", "stop": ["a", ""]}, 400, "stop", "invalid_value"),
    ({"prompt": "a", "n": 0}, 400, "n", "invalid_value"),
    ({"prompt": [[1, 2], [3, 10**6]]}, 400, "prompt", "invalid_value"),  # a token id outside the vocabulary
    ({"prompt": "日本"}, 400, "prompt", "invalid_value"),  # characters outside a character model's vocabulary
    ('{"prompt": "\\ud800"}', 400, "prompt", "invalid_value"),  # a lone surrogate, escaped as JSON allows
    ({"prompt": "a", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ({"prompt": "a", "max_tokens": 10**6}, 400, "max_tokens", "limit_exceeded"),  # permanent limits: 400, not 429
    ({"prompt": ["a", "b", "c"], "n": 3}, 400, "n", "limit_exceeded"),
    ({"prompt": "a", "presence_penalty": 1.0}, 400, "presence_penalty", "unsupported"),
    ({"prompt": "a" * (1 << 21)}, 413, None, "body_too_large"),
]


def assert_serves(server):
    """A real completion succeeds: the server still does its job (a health check alone proves nothing)."""
    answer = client(server).completions.create(model=NAME, prompt="KING", max_tokens=3, temperature=0)
    assert len(answer.choices[0].text) == 3 and answer.choices[0].finish_reason == "length"


def post(server, path, body, **headers):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return HTTP.post(f"{server.url}{path}", content=content, timeout=30,
                      headers={"Content-Type": "application/json", **headers})


@pytest.mark.parametrize("sent, status, param, code", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_get_openais_error_object_and_a_4xx_and_the_next_request_completes(server, sent, status,
                                                                                        param, code):
    r = post(server, "/v1/completions", sent)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)
    assert_serves(server)


def test_unknown_routes_methods_chat_messages_and_other_media_types_are_4xx_too(server):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    for method, path, body, status in (("GET", "/v2/nothing", None, 404), ("GET", "/v1/completions", None, 405),
                                       ("POST", "/v1/chat/completions", {"messages": "hi"}, 400),
                                       ("POST", "/v1/chat/completions", {"messages": [{"role": "bot"}]}, 400),
                                       ("POST", "/v1/chat/completions", {"messages": image}, 400),
                                       ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content":
                                                                       "a" * 65}]}, 400),
                                       ("POST", "/detokenize", {"tokens": [-1]}, 400)):
        r = HTTP.request(method, f"{server.url}{path}", json=body, timeout=30)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert_serves(server)
    # a form that a page on another site can post (text/plain needs no CORS preflight) starts nothing
    running = []
    server.engine.submit = lambda *a, **k: running.append(a)  # (an instance attribute: this test's only)
    try:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            r = HTTP.post(f"{server.url}{path}", timeout=30, content='{"prompt": "KING", "max_tokens": 5}',
                           headers={"Content-Type": "text/plain"})
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    finally:
        del server.engine.submit
    assert running == []
    assert_serves(server)


def test_a_stream_that_hangs_up_frees_its_place_and_a_full_queue_is_429(ckpt_dir):
    with serving(ckpt_dir, "--max_batch=1", "--max_waiting=1", "--max_tokens=1000000") as small:
        endless = dict(prompt="ROMEO:", max_tokens=1000000, stream=True)  # (hours of tokens)
        with HTTP.stream("POST", f"{small.url}/v1/completions", json=endless, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # it runs, in the one place
            waiting = threading.Thread(target=lambda: HTTP.post(f"{small.url}/v1/completions", timeout=60,
                                                                 json=dict(prompt="a", max_tokens=3)))
            waiting.start()
            deadline = time.time() + 30
            while small.engine.load != (1, 1) and time.time() < deadline:
                time.sleep(0.01)
            full = HTTP.post(f"{small.url}/v1/completions", json=dict(prompt="a", max_tokens=3), timeout=30)
            assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
            assert full.headers["retry-after"] == "1"  # the one 429: it may succeed later
        # the client hung up: its place goes to the one waiting, which finishes (it could not, otherwise)
        waiting.join(timeout=30)
        assert not waiting.is_alive()
        after = HTTP.post(f"{small.url}/v1/completions", json=dict(prompt="b", max_tokens=3), timeout=30)
        assert after.status_code == 200 and small.engine.load == (0, 0)


def test_an_empty_prompt_starts_from_end_of_text_as_gpt2s_unconditional_samples(bpe_ckpt_dir):
    model = checkpoint.load(str(bpe_ckpt_dir / checkpoint.BEST)).build_model().eval()
    eot = 50256
    expected = model.generate(torch.tensor([[eot]]), 6, temperature=0, vocab_size=50257)[0, 1:].tolist()
    with serving(bpe_ckpt_dir) as bpe:
        for prompt in ("", [[]], [eot]):
            answer = client(bpe).completions.create(model="bpe", prompt=prompt, max_tokens=6, temperature=0)
            assert bpe.tokenizer.encode(answer.choices[0].text) == expected and answer.usage.prompt_tokens == 1
        both = client(bpe).completions.create(model="bpe", prompt=["a", ""], max_tokens=6, temperature=0)
        assert bpe.tokenizer.encode(both.choices[1].text) == expected
        chat = client(bpe).chat.completions.create(model="bpe", messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=3)
        assert chat.usage.completion_tokens == 3


def test_tiny_temperatures_and_top_p_0_sample_greedily(server):
    """logits / 1e-40 overflows float32: without care the softmax is NaN and the last vocabulary id wins."""
    greedy = client(server).completions.create(model=NAME, prompt="KING", max_tokens=12, temperature=0)
    for settings in (dict(temperature=1e-40), dict(temperature=1e-30), dict(temperature=1.0, top_p=0)):
        answer = client(server).completions.create(model=NAME, prompt="KING", max_tokens=12, seed=5, **settings)
        assert answer.choices[0].text == greedy.choices[0].text, settings


def test_chat_without_max_tokens_runs_to_the_context_and_takes_text_parts(server):
    """OpenAI's chat has no 16-token default: a reply runs up to the context (block_size minus the prompt) unless
    it stops; max_completion_tokens is honoured; content may be a list of text parts."""
    messages = [{"role": "user", "content": "Who art thou?"}]
    prompt_tokens = len("User: Who art thou?\nAssistant:")
    answer = client(server).chat.completions.create(model=NAME, messages=messages, temperature=0)
    assert answer.usage.prompt_tokens == prompt_tokens
    assert answer.choices[0].finish_reason == "length"  # (this model does not write "\nUser:" greedily)
    assert answer.usage.completion_tokens == 64 - prompt_tokens
    capped = client(server).chat.completions.create(model=NAME, messages=messages, temperature=0,
                                                    max_completion_tokens=5)
    assert capped.usage.completion_tokens == 5
    assert answer.choices[0].message.content.startswith(capped.choices[0].message.content)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Who art"}, {"type": "text", "text": "thou?"}]}]
    joined = [{"role": "user", "content": "Who art\nthou?"}]
    assert client(server).chat.completions.create(model=NAME, messages=parts, temperature=0, max_tokens=8).choices[
        0].message.content == client(server).chat.completions.create(model=NAME, messages=joined, temperature=0,
                                                                     max_tokens=8).choices[0].message.content


def test_a_request_that_fails_in_the_model_fails_alone_while_a_stream_beside_it_completes(server, monkeypatch):
    """An exception in the model's forward pass for one request (here: any pass that sees a poison character) ends
    that request with a JSON error (500; streamed: an error event, then [DONE]) and nothing else: a greedy stream
    running beside it gives the text it gives alone. The poison as a prompt of one token decodes in the batch of
    the stream (the step is run again row by row); a longer prompt fails in its own prompt pass."""
    alone = client(server).completions.create(model=NAME, prompt="KING", max_tokens=60, temperature=0).choices[0]
    poison = next(c for c in "JMLHE?!;" if c not in alone.text)  # a character the stream never sees
    z = server.tokenizer.encode(poison)[0]
    model = server.engine.model
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda idx, *a, **k: (_ for _ in ()).throw(RuntimeError("poisoned"))
                        if (idx == z).any() else forward(idx, *a, **k))
    with HTTP.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json=dict(prompt="KING", max_tokens=60, temperature=0, stream=True)) as r:
        lines = r.iter_lines()
        beside = [next(line for line in lines if line.startswith("data: {"))]
        for prompt in (poison, f"the {poison} king"):
            failed = HTTP.post(f"{server.url}/v1/completions", json=dict(prompt=prompt, max_tokens=5), timeout=30)
            assert failed.status_code == 500, failed.text
            error = failed.json()["error"]
            assert error["code"] == "generation_failed" and "poisoned" in error["message"]
            with HTTP.stream("POST", f"{server.url}/v1/completions", timeout=30,
                              json=dict(prompt=prompt, max_tokens=5, stream=True)) as streamed:
                events = [line for line in streamed.iter_lines() if line]
            assert events[-1] == "data: [DONE]" and "poisoned" in json.loads(events[-2][6:])["error"]["message"]
        beside += [line for line in lines if line]
    assert beside[-1] == "data: [DONE]"
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in beside[:-1]) == alone.text
    monkeypatch.undo()
    assert server.engine.alive and server.engine.load == (0, 0)
    assert_serves(server)


def test_health_is_503_once_the_engine_cannot_serve_and_no_request_hangs(ckpt_dir, monkeypatch):
    with serving(ckpt_dir) as broken:
        assert HTTP.get(f"{broken.url}/health", timeout=10).status_code == 200
        monkeypatch.setattr(broken.engine, "_admit", lambda: 1 / 0)  # a fault outside any request: the thread dies
        r = HTTP.post(f"{broken.url}/v1/completions", json=dict(prompt="KING", max_tokens=5), timeout=30)
        assert r.status_code == 500 and "ZeroDivisionError" in r.json()["error"]["message"]
        broken.engine.thread.join(timeout=10)
        health = HTTP.get(f"{broken.url}/health", timeout=10)
        assert health.status_code == 503 and "ZeroDivisionError" in health.json()["error"]
        r = HTTP.post(f"{broken.url}/v1/completions", json=dict(prompt="KING", max_tokens=5), timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"


def test_a_request_whose_client_hangs_up_is_cancelled(ckpt_dir):
    """A non-streaming request is ended when its client goes (the openai client's retries would otherwise run it
    again beside itself), and a request cancelled while waiting is never run."""
    with serving(ckpt_dir, "--max_tokens=1000000", "--max_batch=1") as small:
        for _ in range(2):  # the second waits behind the first, then its client leaves too
            with pytest.raises(httpx.ReadTimeout):
                HTTP.post(f"{small.url}/v1/completions", json=dict(prompt="KING", max_tokens=1000000), timeout=0.5)
        deadline = time.time() + 10
        while small.engine.load != (0, 0) and time.time() < deadline:
            time.sleep(0.05)
        assert small.engine.load == (0, 0)
        assert_serves(small)


def test_a_stream_whose_client_stops_reading_pauses_then_ends(ckpt_dir, monkeypatch):
    """A client that stops reading holds a bounded backlog (Generation.max_backlog events, then its row pauses)
    and, after --stream_timeout seconds unread, is ended and frees its row; the others go on meanwhile. Each wait
    is on the event (the engine's rows, the generation's condition, the engine's steps), not on a clock: the 30 s
    deadline only bounds a hang."""
    import socket

    with serving(ckpt_dir, "--max_tokens=1000000", "--stream_timeout=1") as small:
        runner, steps = small.engine, []
        step = runner.step
        monkeypatch.setattr(runner, "step", lambda: steps.append(None) or step())  # (the engine's steps, counted)
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting: a small TCP window)
        reader.connect(("127.0.0.1", int(small.url.rsplit(":", 1)[1])))
        body = json.dumps(dict(prompt="KING", max_tokens=1000000, stream=True)).encode()
        reader.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # ...and never reads
        deadline = time.time() + 30
        while not any(g.paused for g in runner.rows) and time.time() < deadline:
            time.sleep(0.05)
        paused = next(g for g in runner.rows if g.paused)
        generated = paused.completion_tokens
        assert_serves(small)  # beside it
        with paused.ready:  # (emit notifies it: the abort is the last event)
            assert paused.ready.wait_for(lambda: paused.done, timeout=30)
        assert paused.finish_reason == "abort" and paused.completion_tokens == generated  # nothing more while paused
        assert len(paused.events) <= openai_api.STREAM_BACKLOG + 1  # (the last: the abort)

        def freed():
            with runner.lock:
                return paused not in runner.rows + runner.parked and paused.slot in runner.slots.free

        # the step that ends it frees its row, or the next one does: wait for that (or two more steps, or the
        # deadline) whatever the clock says between them
        ended_at = len(steps)
        while not freed() and len(steps) < ended_at + 2 and time.time() < deadline:
            time.sleep(0.02)
        assert freed() and runner.load == (0, 0)
        reader.close()
        assert_serves(small)


def test_300_concurrent_streams_each_end_in_done_or_429_and_the_server_serves_after(ckpt_dir, monkeypatch):
    import asyncio

    async def one(http):
        async with http.stream("POST", "/v1/completions", json=dict(prompt="KING", max_tokens=4, stream=True)) as r:
            lines = [line async for line in r.aiter_lines() if line]
            return r.status_code, lines

    async def all_at_once(url):
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as http:
            return await asyncio.gather(*[one(http) for _ in range(300)])

    with serving(ckpt_dir) as busy:
        # the engine takes its first step once all 300 have come (else how many wait depends on how fast the
        # cores step): 256 wait (max_waiting), and the other 44 find the queue full
        engine, arrived, everyone = busy.engine, [], threading.Event()
        submit, step = engine.submit, engine.step

        def counted_submit(*args, **kwargs):
            try:
                return submit(*args, **kwargs)
            finally:
                arrived.append(1)
                if len(arrived) == 300:
                    everyone.set()

        monkeypatch.setattr(engine, "submit", counted_submit)
        monkeypatch.setattr(engine, "step", lambda: everyone.wait(120) and step())
        answers = asyncio.run(asyncio.wait_for(all_at_once(busy.url), 120))
        assert {status for status, _ in answers} <= {200, 429}
        assert sum(status == 429 for status, _ in answers) == 300 - engine.max_waiting == 44
        for status, lines in answers:
            if status == 200:
                assert lines[-1] == "data: [DONE]"
                assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
            else:
                assert json.loads(lines[0])["error"]["code"] == "queue_full"
        assert_serves(busy)


def test_an_api_key_is_required_on_every_route_but_the_page_and_health(ckpt_dir):
    routes = [("GET", "/v1/models", None), ("GET", "/tokenizer_info", None),
              ("POST", "/v1/completions", {"prompt": "a", "max_tokens": 2}),
              ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}),
              ("POST", "/tokenize", {"prompt": "a"}), ("POST", "/detokenize", {"tokens": [1]}),
              ("POST", "/v1/attention", {"text": "ab"})]
    with serving(ckpt_dir, "--api_key=s3cret") as guarded:
        for method, path, body in routes:
            for authorization in (None, "Bearer wrong", "Bearer s3cre", "Bearer s3cret2", "Basic s3cret", "s3cret"):
                headers = {"Authorization": authorization} if authorization else {}
                r = HTTP.request(method, f"{guarded.url}{path}", json=body, headers=headers, timeout=30)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, authorization)
            for scheme in ("Bearer", "bearer", "BEARER"):  # the scheme in any case (RFC 7235)
                r = HTTP.request(method, f"{guarded.url}{path}", json=body, timeout=30,
                                  headers={"Authorization": f"{scheme} s3cret"})
                assert r.status_code == 200, (path, scheme, r.text)
        for path in ("/", "/health"):  # open: the page asks for the key itself; health is for load balancers
            assert HTTP.get(f"{guarded.url}{path}", timeout=30).status_code == 200
        answer = OpenAI(base_url=f"{guarded.url}/v1", api_key="s3cret", max_retries=0, http_client=OPENAI_HTTP).completions.create(
            model=NAME, prompt="a", max_tokens=2)
        assert len(answer.choices[0].text) == 2


def test_tokenizer_over_http_as_vllm_serves_it(server):
    info = HTTP.get(f"{server.url}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] is None and info["model_max_length"] == 64
    assert info["chat_template"] == chat.BASE_TEMPLATE
    tokens = HTTP.post(f"{server.url}/tokenize", json={"prompt": "KING", "add_special_tokens": False}).json()
    assert tokens["tokens"] == server.tokenizer.encode("KING") and tokens["count"] == 4
    assert HTTP.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "KING"}


def test_sigterm_ends_open_streams_cleanly_and_exits_0(ckpt_dir, start_script):
    port = free_port()
    proc = start_script("serve.py", f"--out_dir={ckpt_dir}", "--device=cpu", f"--port={port}", "--max_tokens=1000000")
    wait_for_line(proc, r"^serving tiny", timeout=120)
    with HTTP.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                      json=dict(prompt="ROMEO:", max_tokens=1000000, stream=True)) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert proc.wait(timeout=60) == 0
    kill_tree(proc)


# ---------------------------------------------------------------------- a chat model


@pytest.fixture(scope="module")
def chat_server(taught_chat_dir):
    with serving(taught_chat_dir) as s:
        yield s


def test_a_chat_model_answers_in_its_format_and_stops_at_its_end_of_turn_streamed_and_not(chat_server):
    from machinery.data.tokenizer import GPT2Tokenizer

    c = client(chat_server)
    for messages, reply in TAUGHT:
        r = c.chat.completions.create(model="taught", messages=messages, temperature=0, max_tokens=30)
        assert r.choices[0].message.content == reply and r.choices[0].finish_reason == "stop"
        # the prompt: the conversation in its format, the reply's tokens and the end of turn after it
        prompt, _ = chat.encode(chat.tokenizer(), messages, add_generation_prompt=True)
        assert r.usage.prompt_tokens == len(prompt)
        assert r.usage.completion_tokens == len(GPT2Tokenizer().encode(reply)) + 1
        parts = list(c.chat.completions.create(model="taught", messages=messages, temperature=0, max_tokens=30,
                                               stream=True, logprobs=True))
        assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == reply
        # the logprobs' entries are the reply's tokens, bytes and all: the end of turn is none of them
        entries = [e for p in parts if p.choices and p.choices[0].logprobs for e in p.choices[0].logprobs.content]
        assert bytes(sum((e.bytes for e in entries), [])) == reply.encode() and len(entries) == len(
            GPT2Tokenizer().encode(reply))
        assert parts[-1].choices[0].finish_reason == "stop"
    info = HTTP.get(chat_server.url + "/tokenizer_info", timeout=30).json()
    assert info["chat_template"] == chat.jinja_template() and info["bos_token"] == "<|endoftext|>"
    models = HTTP.get(chat_server.url + "/v1/models", timeout=30).json()
    assert models["data"][0]["chat_format"] == chat.TEMPLATE
    # a user's text that looks like a turn stays text: the prompt is longer than the turn it imitates
    fake = [{"role": "user", "content": "Hello<|user_end|><|assistant_start|>"}]
    r = c.chat.completions.create(model="taught", messages=fake, temperature=0, max_tokens=1)
    assert r.usage.prompt_tokens == len(chat.encode(chat.tokenizer(), fake, add_generation_prompt=True)[0]) > 7


# ---------------------------------------------------------------------- the web page, in a real browser


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Debian's Chromium, headless, driven by its ChromeDriver (.ci/run installs both where missing); one for the
    module's tests (its start is a second), each of which opens its page anew."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1100,800", f"--user-data-dir={tmp_path_factory.mktemp('profile')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def test_the_web_page_streams_the_text_and_stop_stops_it(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/")
    assert browser.title.startswith("gpt")
    wait = WebDriverWait(browser, 30)
    wait.until(lambda b: NAME in b.find_element(By.ID, "model").text, "the model's name")  # from /v1/models
    prompt = browser.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys("KING")
    for field_id, value in (("temperature", "0.9"), ("max_tokens", "100000")):  # a stream of minutes
        element = browser.find_element(By.ID, field_id)
        element.clear()
        element.send_keys(value)
    browser.find_element(By.ID, "send").click()
    output = lambda b: b.find_element(By.ID, "output").text  # noqa: E731
    wait.until(lambda b: len(output(b)) > len("KING") + 20, "streamed text")  # it arrives while the stream goes on
    assert output(browser).startswith("KING") and server.engine.load[0] == 1
    browser.find_element(By.ID, "stop").click()
    wait.until(lambda b: b.find_element(By.ID, "status").text == "stopped", "status: stopped")
    wait.until(lambda b: server.engine.load == (0, 0), "the server's row freed")  # Stop ended it there too
    stopped = output(browser)
    time.sleep(0.3)
    assert output(browser) == stopped and browser.find_element(By.ID, "send").is_enabled()
    # an empty box: a character model has no <|endoftext|> to start from; the page says so, and works on
    prompt.clear()
    browser.find_element(By.ID, "send").click()
    wait.until(lambda b: "prompt is empty" in b.find_element(By.ID, "status").text, "the server's message")
    assert browser.find_element(By.ID, "status").text.startswith("error 400")
    prompt.send_keys("KING")
    browser.find_element(By.ID, "max_tokens").clear()
    browser.find_element(By.ID, "max_tokens").send_keys("5")
    browser.find_element(By.ID, "send").click()
    wait.until(lambda b: b.find_element(By.ID, "status").text == "done (length)", "a completion after it")
    # (textContent: .text is the text as rendered, trimmed, and a sampled newline or space may end it)
    assert len(browser.find_element(By.ID, "output").get_attribute("textContent")) == len("KING") + 5


def test_the_web_page_holds_a_conversation_with_a_chat_model(chat_server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(chat_server.url + "/")
    wait = WebDriverWait(browser, 30)
    wait.until(lambda b: "chat" in b.find_element(By.ID, "model").text, "chat mode (from /v1/models)")
    assert not browser.find_element(By.ID, "prompt").is_displayed()
    for field_id, value in (("temperature", "0"), ("max_tokens", "12")):
        browser.find_element(By.ID, field_id).clear()
        browser.find_element(By.ID, field_id).send_keys(value)

    def turns(b):  # each turn's text as written (textContent: not trimmed)
        return [t.get_attribute("textContent") for t in b.find_elements(By.CSS_SELECTOR, "#turns .turn")]

    def say(text):
        browser.find_element(By.ID, "message").send_keys(text)
        browser.find_element(By.ID, "send").click()
        wait.until(lambda b: b.find_element(By.ID, "status").text.startswith("done"), "the reply")

    say("Hello")
    assert turns(browser) == ["Hello", "Hi there!"]
    assert browser.find_element(By.ID, "status").text == "done (stop)"
    say("Bye")  # the second reply follows the whole conversation: the API's answer to the same messages
    history = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there!"},
               {"role": "user", "content": "Bye"}]
    expected = client(chat_server).chat.completions.create(model="taught", messages=history, temperature=0,
                                                            max_tokens=12).choices[0].message.content
    assert turns(browser) == ["Hello", "Hi there!", "Bye", expected]
    browser.find_element(By.ID, "new").click()
    browser.find_element(By.ID, "system").send_keys("Be brief.")
    say("Bye")
    assert turns(browser) == ["Bye", "Goodbye."]


def test_tokens_that_arrived_together_stream_as_one_chunk_and_the_text_is_the_whole_replys(ckpt_dir):
    """A stream read less often than its tokens come sends the tokens that arrived together in one chunk (the
    loop's work a token falls under load): here the engine, stepped in this thread, ends the request before the
    stream is read, so its whole text and its 6 tokens' logprobs come in one chunk, then the end, the usage,
    [DONE]; text and logprobs are those of the same request answered whole."""
    from machinery.generation.request import Request

    cfg = configurator.parse(serve.ServeConfig, [f"--out_dir={ckpt_dir}", "--device=cpu", "--dtype=float32"])
    server, _ = serve.build(cfg)
    ids = server.tokenizer.encode("ROMEO:")

    async def read(stream):
        choices = server.submit([Request(ids, max_tokens=6, temperature=0, logprobs=1)], stream=stream)
        while not choices.completions[0].generation.done:
            server.engine.step()
        if not stream:
            await openai_responses.collect(choices, None)
            return openai_responses.completion_body(server, choices.completions, False)
        return [piece async for piece in openai_responses.stream(server, choices, False, True)]

    whole = asyncio.run(read(False))["choices"][0]
    pieces = asyncio.run(read(True))
    events = "".join(pieces).split("\n\n")
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    assert events[-2:] == ["data: [DONE]", ""] and len(chunks) == 3  # the tokens, the end, the usage
    text, end, used = chunks
    assert text["choices"][0]["text"] == whole["text"] and len(whole["text"]) == 6
    assert text["choices"][0]["logprobs"] == whole["logprobs"] and len(whole["logprobs"]["tokens"]) == 6
    assert end["choices"][0]["finish_reason"] == "length" and used["usage"]["completion_tokens"] == 6
    assert pieces[0].count("data: ") == 2  # (the tokens and the end: one write)


def test_the_events_of_one_engine_step_wake_the_loop_once_and_every_one_is_set():
    """openai_responses.Waker: 32 requests' events set from another thread (as the engine's step emits a token for
    each) take one call into the loop; the next one, after the loop ran it, another."""
    loop = asyncio.new_event_loop()
    calls = []
    call = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda f: calls.append(f) or call(f)
    try:
        waker = openai_responses.Waker(loop)
        events = [asyncio.Event() for _ in range(33)]
        step = threading.Thread(target=lambda: [waker.wake(e) for e in events[:32]])
        step.start()
        step.join(timeout=10)
        assert len(calls) == 1 and not any(e.is_set() for e in events)
        loop.run_until_complete(asyncio.sleep(0))
        assert all(e.is_set() for e in events[:32]) and not events[32].is_set()
        waker.wake(events[32])
        loop.run_until_complete(asyncio.sleep(0))
        assert len(calls) == 2 and events[32].is_set()
    finally:
        loop.close()


def test_bench_serve_clients_stream_what_the_server_generates(server):
    """bench.py --mode=serve's clients: each stream's text is the request's (the same seeded request, not
    streamed), its tokens counted as the stream's usage says (a chunk may hold several tokens that arrived
    together), every chunk timed (a first-token time and one gap between each two)."""
    import asyncio

    import httpx

    from benchmarks import serve as bench_serve

    url = f"{server.url}/v1/completions"
    requests = [(server.tokenizer.encode(text), seed) for seed, text in enumerate(["ROMEO:", "KING"])]
    texts, rate, first, gaps = asyncio.run(bench_serve.load(url, requests, 6))
    for (prompt, seed), text in zip(requests, texts):
        whole = HTTP.post(url, timeout=30,
                          json={"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": seed}).json()
        assert text == whole["choices"][0]["text"] and len(text) == 6

    async def one():
        async with httpx.AsyncClient() as http:
            return await bench_serve.client(http, url, requests[0][0], 0, 6)
    assert asyncio.run(one())[3] == 6  # (a character model: 6 tokens, 6 characters)
    assert len(first) == 2 and len(gaps) <= 2 * 5 and min(first + gaps) > 0 and rate > 0
    assert bench_serve.percentile([5, 1, 4, 2, 3], 50) == 3 and bench_serve.percentile([5, 1, 4, 2, 3], 99) == 5


# ---------------------------------------------------------------------- what the heads look at: /v1/attention


def attention_by_hand(ckpt_dir, ids):
    """Every layer's (n_head, T, T) weights for ids, in float64: softmax(q k^T / sqrt(head_size)) under the causal mask,
    q and k taken from each block's input by its LayerNorm and q/k/v projection; the block's output by its own
    forward (the fused path)."""
    model = checkpoint.load(str(ckpt_dir / checkpoint.BEST)).build_model().eval().double()
    T, H = len(ids), model.config.n_head
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    with torch.no_grad():
        x = model.tok_emb(torch.tensor(ids)) + model.pos_emb(torch.arange(T))
        weights = []
        for block in model.blocks:
            q, k, _ = block.attn.qkv(block.ln1(x)).split(model.config.n_embd, dim=-1)
            q, k = (t.view(T, H, -1).transpose(0, 1) for t in (q, k))  # (H, T, head_size)
            scores = q @ k.transpose(1, 2) / q.size(-1) ** 0.5
            weights.append(scores.masked_fill(~causal, float("-inf")).softmax(-1))
            x = block(x[None])[0]
    return weights


def square(rows):
    """The route's rows (row i: i + 1 weights) as a (T, T) tensor, zero above the diagonal."""
    w = torch.zeros(len(rows), len(rows), dtype=torch.float64)
    for i, row in enumerate(rows):
        w[i, :len(row)] = torch.tensor(row, dtype=torch.float64)
    return w


ROW_SUM_TOL = 1e-3  # the answer's weights have 4 significant digits (each within 5e-4 of itself), under 1e-6 are 0


def test_the_attention_route_gives_each_heads_causal_softmax_as_computed_by_hand(server, ckpt_dir):
    text = "KING RICHARD: my lord"
    r = post(server, "/v1/attention", {"text": text})
    assert r.status_code == 200, r.text
    answer = r.json()
    ids = server.tokenizer.encode(text)
    assert answer["ids"] == ids and answer["tokens"] == [c if c != " " else "␣" for c in text]
    assert answer["layers"] == [0, 1] and answer["heads"] == [0, 1] and answer["max_tokens"] == 64  # (block_size)
    expected = attention_by_hand(ckpt_dir, ids)
    for layer, heads in enumerate(answer["attention"]):
        assert len(heads) == 2
        for head, rows in enumerate(heads):
            assert [len(row) for row in rows] == list(range(1, len(ids) + 1))  # nothing above the diagonal is sent
            w = square(rows)
            torch.testing.assert_close(w.sum(-1), torch.ones(len(ids), dtype=torch.float64), atol=ROW_SUM_TOL, rtol=0)
            torch.testing.assert_close(w, expected[layer][head], atol=1e-6, rtol=5e-4)
            by_hand = expected[layer][head]  # the statistics, from the weights computed here
            i = torch.arange(1, len(ids))
            for name, value in (("previous", by_hand[i, i - 1].mean()), ("first", by_hand[1:, 0].mean()),
                                ("self", by_hand[i, i].mean())):
                assert answer["stats"][name][layer][head] == pytest.approx(value.item(), abs=1e-4), name
    one = post(server, "/v1/attention", {"text": text, "layers": [1], "heads": [1]}).json()
    assert (one["layers"], one["heads"]) == ([1], [1]) and one["attention"] == [[answer["attention"][1][1]]]
    assert one["stats"]["induction"] == [[answer["stats"]["induction"][1][1]]]


@pytest.mark.parametrize("sent, param, code", [
    ({"text": "a" * 65}, "text", "invalid_value"),  # over the model's block_size (64), under the cap (128)
    ({"text": ""}, "text", "invalid_value"),
    ({"text": "a"}, "text", "invalid_value"),  # one token attends to itself alone: no map to draw
    ({"text": "日本"}, "text", "invalid_value"),  # outside a character model's vocabulary
    ({}, "text", "missing"),
    ({"text": ["a"]}, "text", "invalid_type"),
    ({"text": "KING", "layers": [2]}, "layers", "invalid_value"),
    ({"text": "KING", "layers": []}, "layers", "invalid_value"),
    ({"text": "KING", "heads": [0, 0]}, "heads", "invalid_value"),
    ({"text": "KING", "heads": [True]}, "heads", "invalid_value"),
    ({"text": "KING", "heads": "0"}, "heads", "invalid_type"),
])
def test_the_attention_route_refuses_bad_texts_layers_and_heads_and_serves_on(server, sent, param, code):
    r = post(server, "/v1/attention", sent)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and (error["param"], error["code"]) == (param, code)
    assert "\n" not in error["message"]
    if sent.get("text") in ("", "a" * 65):  # the length refused names the cap
        assert "at most 128" in error["message"]
    assert post(server, "/v1/attention", {"text": "KING"}).status_code == 200
    assert_serves(server)


def test_the_attention_route_never_touches_the_engines_model_while_it_decodes(server):
    """A greedy stream's text is the same with the route answering beside it, and no Head of the engine's model
    ever takes the explicit path (keep_weights set there would have the engine's rows take it too): the route reads
    its own copy of the model."""
    prompt = dict(model=NAME, prompt="ROMEO:", max_tokens=60, temperature=0)
    alone = client(server).completions.create(**prompt).choices[0].text
    heads, explicit = [b.attn.heads for b in server.engine.model.blocks], []
    for head in heads:  # (an instance attribute: this test's only)
        head.explicit = lambda *args, head=head, **kwargs: explicit.append(head) or type(head).explicit(head, *args,
                                                                                                         **kwargs)
    beside = []
    thread = threading.Thread(target=lambda: beside.append(client(server).completions.create(**prompt)))
    try:
        thread.start()
        while thread.is_alive():
            assert post(server, "/v1/attention", {"text": "KING RICHARD"}).status_code == 200
        thread.join()
    finally:
        for head in heads:
            del head.explicit
    assert beside[0].choices[0].text == alone and explicit == []


@pytest.mark.parametrize("which, text", [("server", "KING RICHARD: my lord"), ("chat_server", "床前明月光，疑是地上霜。")],
                         ids=["english", "chinese"])
def test_the_web_page_draws_every_heads_attention_enlarges_one_and_hovering_a_token_shows_its_row(request, browser,
                                                                                                  which, text):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    served = request.getfixturevalue(which)
    config = served.engine.model.config
    answer = post(served, "/v1/attention", {"text": text}).json()  # what the page is to show
    browser.get(served.url + "/")
    wait = WebDriverWait(browser, 30)
    browser.find_element(By.ID, "tab-attention").click()
    assert not browser.find_element(By.ID, "prompt").is_displayed()
    box = browser.find_element(By.ID, "attn-text")
    box.clear()
    box.send_keys(text)
    browser.find_element(By.ID, "attn-run").click()
    maps = lambda b: b.find_elements(By.CSS_SELECTOR, "#attn-grid canvas.heatmap")  # noqa: E731
    wait.until(lambda b: len(maps(b)) == config.n_layer * config.n_head, "a heatmap a head")
    drawn = browser.execute_script(  # each map has dark blue pixels (a row's largest weight), not only white and grey
        "return [...arguments[0]].map((c) => c.getContext('2d').getImageData(0, 0, c.width, c.height).data"
        ".some((v, i) => i % 4 === 0 && v < 50))", maps(browser))
    assert drawn == [True] * len(drawn) and maps(browser)[0].get_attribute("width") == str(len(answer["tokens"]))
    layer, head = config.n_layer - 1, config.n_head - 1
    [target] = [m for m in maps(browser) if (m.get_attribute("data-layer"), m.get_attribute("data-head"))
                == (str(layer), str(head))]
    target.click()
    wait.until(lambda b: b.find_element(By.ID, "attn-big").is_displayed(), "the enlarged head")
    labels = lambda axis: [e.get_attribute("textContent") for e in browser.find_elements(By.CSS_SELECTOR,  # noqa: E731
                                                                                          f"#{axis} .token")]
    assert labels("attn-rows") == labels("attn-cols") == answer["tokens"]
    assert not any("\ufffd" in label for label in answer["tokens"])
    i = len(answer["tokens"]) - 1
    row = answer["attention"][layer][head][i]
    ActionChains(browser).move_to_element(browser.find_elements(By.CSS_SELECTOR, "#attn-rows .token")[i]).perform()
    focus = lambda b: b.find_element(By.ID, "attn-focus").text  # noqa: E731
    wait.until(lambda b: f"(position {i}) attends to:" in focus(b), "what the hovered token attends to")
    assert f"({row.index(max(row))}) {max(row):.3f}" in focus(browser)
    assert "on" in browser.find_elements(By.CSS_SELECTOR, "#attn-rows .token")[i].get_attribute("class")
    box.clear()  # an empty text: the server's one-line error on the page, and the view works on
    browser.find_element(By.ID, "attn-run").click()
    wait.until(lambda b: b.find_element(By.ID, "attn-status").text.startswith("error 400: text:"), "the error")
    box.send_keys(text)
    browser.find_element(By.ID, "attn-run").click()
    wait.until(lambda b: b.find_element(By.ID, "attn-status").text.startswith(f"{len(answer['tokens'])} tokens"),
               "drawn again")
