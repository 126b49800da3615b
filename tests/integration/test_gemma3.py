"""The default real model (Gemma 3 270M from PyPI, assembled by scripts/fetch-gemma3.sh)
served by nginx with the module on the CPU, asked a short question through the
official OpenAI SDK. Skips when the model has not been fetched."""
import os

import openai
import pytest

import harness
from test_instances import minimal_with

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GEMMA = os.environ.get("M40_GEMMA3", os.path.join(ROOT, "models-cache", "gemma-3-270m-q4_k_m.gguf"))


@pytest.mark.skipif(not os.path.isfile(GEMMA), reason="Gemma 3 not fetched (scripts/fetch-gemma3.sh)")
def test_gemma3_answers_a_short_question(instances):
    port = harness.free_port()
    instances(minimal_with(port, "    m40_ctx_size 512;\n    m40_max_seqs 2;\n", "gemma3", model=GEMMA),
              "gemma3", port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=300)
    name = client.models.list().data[0].id
    assert name == "gemma-3-270m-q4_k_m"
    r = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    text = r.choices[0].message.content
    assert text and text.strip(), r
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 5 and 0 < u.completion_tokens <= 24
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    # the completions endpoint on a plain prompt gives English continuing it
    c = client.completions.create(model=name, prompt="The capital of France is", max_tokens=12, temperature=0)
    assert any(w in c.choices[0].text for w in ("Paris", "France", "city", "capital")), c.choices[0].text
