"""Stream a completion from a running target service, piece by piece as rounds commit.

    deltaspec serve-draft --port 50052 &
    deltaspec serve-target --port 50051 --draft-addr 127.0.0.1:50052 &
    python examples/stream_completion.py 127.0.0.1:50051 "class Stack:"

Sampled (temperature 0.8, top-p 0.9, a fixed seed): the embedded pair is small enough to loop when greedy.
"""
import sys

from deltaspec import Client

target = sys.argv[1]
prompt = sys.argv[2] if len(sys.argv) > 2 else "class Point:\n    def __init__(self, x, y):\n"
with Client(target) as client:
    print(prompt, end="")
    for piece in client.stream(prompt, max_new_tokens=128, temperature=0.8, top_p=0.9, seed=1):
        print(piece.text, end="", flush=True)
print()
