"""One process's part in a sync group, without Ray: what every rank kind shares.

`Participant` reports tensors, joins the group and runs rounds;
`TrainerRank` adds the sending side (sources), `WorkerRank` the receiving
side (destinations, versions, double buffering, fallbacks, patches, CUDA
IPC export). The Ray layer (`actors`) mixes them into actors and reads the
node identity off Ray; the vLLM weight-transfer backend (`rl_sync.vllm.backend`)
runs a `WorkerRank` inside vLLM's own worker processes. The coordinator calls
the `_rl_sync_*` methods listed in `protocol.SyncRank`; users never do.
"""

from .participant import Participant
from .protocol import SyncRank
from .trainer import TrainerRank
from .worker import WorkerRank

__all__ = ["Participant", "SyncRank", "TrainerRank", "WorkerRank"]
