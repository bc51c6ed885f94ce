"""``moeserve serve`` with no model: the shipped chat model answers held-out questions over HTTP."""

from __future__ import annotations

import asyncio

import openai

from moeserve.models.tiny_chat import held_out_prompts, is_correct
from tests.e2e.server_utils import start_server


def test_embedded_model_answers_held_out_prompts(tmp_path):
    srv = start_server([], str(tmp_path / "log"))
    try:
        async def ask_all(items):
            client = openai.AsyncOpenAI(base_url=f"{srv.base_url}/v1", api_key="none", max_retries=0)
            replies = await asyncio.gather(*(
                client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": q}],
                                               temperature=0, max_tokens=16) for q, _ in items))
            await client.close()
            return replies

        items = held_out_prompts(100, seed=7)
        replies = asyncio.run(ask_all(items))
        correct = sum(is_correct(q, r.choices[0].message.content) for (q, _), r in zip(items, replies))
        assert all(r.choices[0].finish_reason == "stop" for r in replies)  # the model ends its answers
        assert correct >= 95, f"{correct}/100 correct"
    finally:
        assert srv.stop() == 0
