"""Chat and text on the real cluster with a model that HAS a tokenizer: the tiny preset's shapes,
a byte-level vocabulary and a chat template (tiny_hf_dir.py), on configs/tiny-1p1d.yaml's fleet.
Chat token ids equal `Cluster.generate` on the template-rendered prompt; text equals the
tokenizer's decode; a stop string cuts the text before it, streaming or not."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from tiny_hf_dir import write_tiny_hf_dir

from disagg.cluster import Cluster
from disagg.cluster.serve import BackgroundServer, build_app
from disagg.config import Config
from disagg.sampling import SamplingParams

pytestmark = pytest.mark.timeout(240)
CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny-1p1d.yaml"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def served(ray_local, tmp_path_factory):
    model_dir = write_tiny_hf_dir(tmp_path_factory.mktemp("tiny-hf"))
    config = Config.from_yaml(CONFIG).override({"model.source": str(model_dir)})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")  # passed on to the actors
        cluster = Cluster.launch(config)
    try:
        with BackgroundServer(build_app(cluster, config)) as server:
            client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
            yield cluster, client
    finally:
        cluster.shutdown()


def test_chat_ids_equal_generate_and_text_equals_decode(served):
    cluster, client = served
    tokenizer = cluster.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    want = cluster.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    out = client.chat.completions.create(model=cluster.model_name, messages=MESSAGES, max_tokens=12,
                                         temperature=0, extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert out.model_extra["prompt_token_ids"] == prompt
    assert choice.model_extra["token_ids"] == want.token_ids and choice.finish_reason == want.finish_reason
    text_ids = want.token_ids[:-1] if want.finish_reason == "stop" else want.token_ids
    assert choice.message.content == tokenizer.decode(text_ids)
    chunks = list(client.chat.completions.create(model=cluster.model_name, messages=MESSAGES, max_tokens=12,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content


def test_stop_string_on_real_text(served):
    cluster, client = served
    base = client.completions.create(model=cluster.model_name, prompt="The cat", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    printable = [i for i in range(2, len(text) - 2) if text[i:i + 2].isprintable()]
    assert printable, f"no printable pair to stop on in {text!r}"
    stop = text[printable[0]:printable[0] + 2]
    expected = text[:text.find(stop)]
    out = client.completions.create(model=cluster.model_name, prompt="The cat", max_tokens=24, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(
        model=cluster.model_name, prompt="The cat", max_tokens=24, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True})]
    assert "".join(pieces) == expected
