"""``moeserve demo``: serve the shipped chat model, talk to it with the openai client, load it
briefly with the serving benchmark, and shut everything down."""

from __future__ import annotations

import argparse

from moeserve.models.tiny_chat import held_out_prompts


def _chat(base_url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="demo")
    for question, expected in held_out_prompts(4, seed=2024):
        reply = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": question}],
                                               temperature=0, max_tokens=16)
        answer = reply.choices[0].message.content
        mark = "ok" if answer.strip() == expected else f"expected {expected}"
        print(f"  user: {question:<24} assistant: {answer:<10} ({mark})")
    question = "What is 404+317?"
    print(f"  user: {question:<24} assistant (streaming): ", end="", flush=True)
    stream = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": question}],
                                            temperature=0, max_tokens=16, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()


def _bench(base_url: str) -> None:
    from moeserve.bench.serving import add_serving_args, run_serving_benchmark

    parser = argparse.ArgumentParser()
    add_serving_args(parser)
    run_serving_benchmark(parser.parse_args(["--base-url", base_url, "--num-prompts", "32", "--request-rate", "16",
                                             "--random-input-len", "24", "--random-output-len", "8"]))


def _pd_backend() -> str:
    """NIXL where it imports (``make setup`` installs it), else torch.distributed."""
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return "torch"
    return "nixl"


def run_pd_demo() -> int:
    from moeserve.server import procs

    backend = _pd_backend()
    print(f"starting one prefill server, one decode server (KV over {backend}) and the PD router ...")
    with procs.running(procs.pd_deployment([], [], [], backend)) as deployment:
        router = deployment[-1]
        print(f"chat through the router at {router.url}:")
        _chat(router.url)
    print("\nprefill, decode and router stopped")
    return 0


def run_demo() -> int:
    from moeserve.server import procs

    print("starting `moeserve serve` (the shipped tiny DeepSeek-V3-architecture chat model) ...")
    server = procs.start("server", ["serve"])
    try:
        print(f"chat through the openai client at {server.url}:")
        _chat(server.url)
        print("\na short serving benchmark (32 requests):")
        _bench(server.url)
    finally:
        code = server.stop()
        print(f"\nserver stopped (exit code {code})")
    return 0
