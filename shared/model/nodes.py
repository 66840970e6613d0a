"""Where the ranks of a tensor-parallel group run: on one host, or over several nodes as torchrun places them.

Every node runs `serve-target` once, with the same `--tensor-parallel N --nnodes M` and its own `--node-rank r`:
it holds the N/M global ranks r N/M .. (r+1) N/M - 1, its own process the first of them and child processes the
others (a node's i-th rank on its GPU i). Global rank 0, node 0's process, hosts the rendezvous at
`--master-addr:--master-port`, leads (`lockstep.Leader`) and serves gRPC. Every other node's process is a follower
and serves nothing: it exits 70 when the group breaks (its supervisor restarts it with the group) and 0 when rank 0
stops the group. A rank waits up to `wait_s` for all N to meet: `RENDEZVOUS_S` over several nodes (they start
minutes apart: image pulls, checkpoint loads), the group's `lockstep.TIMEOUT_S` on one host (its ranks load side by
side); once met, a collective that waits `lockstep.TIMEOUT_S` breaks the group.

Under torchrun (`Placement.from_torchrun`) every process torchrun starts is one rank, RANK of WORLD_SIZE on GPU
LOCAL_RANK, meeting at the store its agent holds: no child processes; rank 0 serves, and torchrun, seeing a rank
exit, stops the others and restarts the group (`--max-restarts`).
"""
from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from deltaspec.shared.model import lockstep
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.parallel import shard

RENDEZVOUS_S = 600.0


@dataclass(frozen=True)
class Placement:
    """A group of `world` ranks over `nnodes` nodes, as this node (`node_rank`) sees it; refuses sizes and ranks that
    cannot form one (ValueError naming the flag)."""

    world: int
    master_addr: str
    master_port: int
    nnodes: int = 1
    node_rank: int = 0
    wait_s: float | None = None  # how long a rank waits for all to meet (None: as the layout calls for)
    first_device: int = 0  # the GPU index of this node's first rank
    torchrun: bool = False  # launched by torchrun: its agent holds the rendezvous (env://)

    @classmethod
    def from_torchrun(cls, env: Mapping[str, str], tensor_parallel: int) -> Placement | None:
        """This process's place when torchrun started it (TORCHELASTIC_RUN_ID set): one rank, RANK of WORLD_SIZE, on
        GPU LOCAL_RANK; None otherwise. --tensor-parallel, when given, must be torchrun's WORLD_SIZE. Its agents
        have met already: the ranks wait the group's timeout for each other."""
        if "TORCHELASTIC_RUN_ID" not in env:
            return None
        world = int(env["WORLD_SIZE"])
        if tensor_parallel not in (1, world):
            raise ValueError(f"--tensor-parallel {tensor_parallel} is not torchrun's WORLD_SIZE {world}: under "
                             "torchrun every process is one rank")
        return cls(world, env["MASTER_ADDR"], int(env["MASTER_PORT"]), nnodes=world, node_rank=int(env["RANK"]),
                   first_device=int(env["LOCAL_RANK"]), torchrun=True)

    def __post_init__(self) -> None:
        if self.world < 1 or self.nnodes < 1:
            raise ValueError(f"--tensor-parallel ({self.world}) and --nnodes ({self.nnodes}) must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is not one of the {self.nnodes} nodes' (0 to "
                             f"{self.nnodes - 1})")
        if self.world % self.nnodes:
            raise ValueError(f"--tensor-parallel {self.world} is not a multiple of --nnodes {self.nnodes}: every "
                             "node runs the same number of ranks")
        if not self.master_addr or not 0 < self.master_port < 65536:
            raise ValueError(f"the group meets at --master-addr:--master-port (or $MASTER_ADDR:$MASTER_PORT), node "
                             f"0's address and a free port there; got {self.master_addr!r}:{self.master_port}")
        if self.wait_s is not None and not self.wait_s > 0:
            raise ValueError(f"--rendezvous-timeout must be more than 0 seconds, got {self.wait_s}")

    @property
    def meet_s(self) -> float:
        """How long a rank waits for all to meet: `wait_s` if given, else `RENDEZVOUS_S` over several nodes and the
        group's timeout on one host or under torchrun (whose agents have met already)."""
        if self.wait_s is not None:
            return self.wait_s
        return RENDEZVOUS_S if self.nnodes > 1 and not self.torchrun else lockstep.TIMEOUT_S

    @property
    def ranks(self) -> range:
        """This node's global ranks, its own process's first."""
        local = self.world // self.nnodes
        return range(self.node_rank * local, (self.node_rank + 1) * local)

    @property
    def rendezvous(self) -> str:
        return "env://" if self.torchrun else f"tcp://{self.master_addr}:{self.master_port}"

    def device(self, rank: int, device: str) -> str:
        """Where global `rank` lives on this node: `cuda` is the node's GPU of its local index."""
        return f"cuda:{self.first_device + rank - self.ranks.start}" if device == "cuda" else device

    def join(self, rank: int) -> lockstep.Rank:
        """Join the group as global `rank`; a ConnectionError names the rendezvous when the group does not form
        within `meet_s`."""
        try:
            return lockstep.join(rank, self.world, self.rendezvous, wait_s=self.meet_s)
        except RuntimeError as error:  # torch's DistNetworkError / DistStoreError, a timeout either way
            raise ConnectionError(f"tensor parallel rank {rank} of {self.world} could not meet the others at "
                                  f"{self.master_addr}:{self.master_port} within {self.meet_s:g} s: "
                                  f"{str(error).splitlines()[0]}") from None


def start_followers(at: Placement, model_dir: str, device: str, threads: int,
                    expert_parallel: bool = False) -> list[BaseProcess]:
    """This node's ranks after its first, each a child process that loads, shards, joins and follows rank 0
    (`expert_parallel`: its shard holds E/N whole experts, `parallel.shard`)."""
    spawn = multiprocessing.get_context("spawn")
    followers = [spawn.Process(target=follower_main, daemon=True, name=f"deltaspec-tp-rank{rank}",
                               args=(at, rank, model_dir, at.device(rank, device), threads, expert_parallel))
                 for rank in at.ranks[1:]]
    for p in followers:
        p.start()
    return followers


def follower_main(at: Placement, rank: int, model_dir: str, device: str, threads: int,
                  expert_parallel: bool = False) -> None:
    """A follower rank's process: follow rank 0 until it stops the group (or the group breaks: raises)."""
    lockstep.follow(*_joined(at, rank, model_dir, device, threads, expert_parallel))


def _joined(at: Placement, rank: int, model_dir: str, device: str, threads: int,
            expert_parallel: bool = False) -> tuple[HybridLM, lockstep.Rank]:
    """Global `rank`'s shard, loaded, and its place in the group, joined."""
    torch.set_num_threads(threads)
    model = load_model(model_dir, device=device)
    joined = at.join(rank)
    return shard(model, joined, expert_parallel), joined


def follow_node(at: Placement, model_dir: str, device: str, threads: int, expert_parallel: bool = False) -> int:
    """A node other than node 0 (under torchrun: a rank other than 0): its ranks follow rank 0; no gRPC. Returns 0
    once rank 0 stops the group; exits 70 when it breaks (a rank gone or silent), after this node's child ranks are
    gone too. A checkpoint that does not load or a group that does not form raises, as at any start."""
    followers = start_followers(at, model_dir, device, threads, expert_parallel)
    print(f"tensor parallel: ranks {at.ranks.start}..{at.ranks.stop - 1} of {at.world} follow rank 0 at "
          f"{at.master_addr}:{at.master_port}", file=sys.stderr, flush=True)
    try:
        part, joined = _joined(at, at.ranks.start, model_dir, at.device(at.ranks.start, device), threads,
                               expert_parallel)
    except BaseException:
        _end(followers, 0)
        raise
    try:
        lockstep.follow(part, joined)
    except Exception as error:  # noqa: BLE001 - the group broke: this node's ranks can no longer follow
        _end(followers, 10)
        lockstep.exit_group(error)  # at once: gloo's threads would abort an orderly interpreter exit
    _end(followers, 10)
    dist.destroy_process_group()
    return 0


def _end(followers: list[BaseProcess], wait_s: float) -> None:
    """The child ranks gone: given `wait_s` each to end by themselves, then killed."""
    for p in followers:
        p.join(wait_s)
        if p.is_alive():
            p.kill()
            p.join()
