"""The same with asyncio: several completions in flight on one channel, each awaited whole.

    python examples/async_completion.py 127.0.0.1:50051
"""
import asyncio
import json
import sys

from deltaspec.shared.client import AsyncClient


async def main(target: str) -> None:
    async with AsyncClient(target) as client:
        prompts = ["def fib(n):", "import os\n", "class Stack:"]
        done = await asyncio.gather(*(client.generate(p, max_new_tokens=24) for p in prompts))
    for completion in done:
        print(json.dumps({"token_ids": completion.token_ids, "text": completion.text,
                          "acceptance_rate": completion.stats["acceptance_rate"]}))


asyncio.run(main(sys.argv[1]))
