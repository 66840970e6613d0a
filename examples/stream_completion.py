"""Stream a completion from a running target service, piece by piece as rounds commit.

    deltaspec serve-draft --port 50052 &
    deltaspec serve-target --port 50051 --draft-addr 127.0.0.1:50052 &
    python examples/stream_completion.py 127.0.0.1:50051 "def fib(n):"
"""
import sys

from deltaspec.shared.client import Client

target, prompt = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "def fib(n):"
with Client(target) as client:
    for piece in client.stream(prompt, max_new_tokens=48):
        print(piece.text, end="", flush=True)
print()
