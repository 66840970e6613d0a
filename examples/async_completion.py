"""The same with asyncio: several completions in flight on one channel, each awaited whole.

    python examples/async_completion.py 127.0.0.1:50051
"""
import asyncio
import json
import sys

from deltaspec import AsyncClient


async def main(target: str) -> None:
    async with AsyncClient(target) as client:
        prompts = ["class Stack:\n    def __init__(self):\n", "import os\n", "    def __repr__(self):\n"]
        done = await asyncio.gather(*(client.generate(p, max_new_tokens=48, temperature=0.8, top_p=0.9, seed=1)
                                      for p in prompts))
    for completion in done:
        print(json.dumps({"token_ids": completion.token_ids, "text": completion.text,
                          "acceptance_rate": completion.stats["acceptance_rate"]}))


asyncio.run(main(sys.argv[1]))
