"""Python client of the rollarc rollout service.

    from rollarc import Client

    c = Client("http://127.0.0.1:8080")
    job = c.submit("examples/quickstart.toml")
    for ev in c.events(job):
        print(ev.event, ev.data.get("step"))

See the package README (clients/python/README.md) for the trainer API.
"""

from .client import (
    Batch,
    Client,
    Episode,
    Event,
    LeaseLost,
    RollarcError,
    TERMINAL_STATES,
)
from .types import (
    AgentCall,
    BatchGroup,
    JobRecord,
    Sample,
    Staleness,
    StepRecord,
    ToolCall,
    TrajectoryRow,
    Turn,
    sequences,
)

__all__ = [
    "AgentCall",
    "Batch",
    "BatchGroup",
    "Client",
    "Episode",
    "Event",
    "JobRecord",
    "LeaseLost",
    "RollarcError",
    "Sample",
    "Staleness",
    "StepRecord",
    "TERMINAL_STATES",
    "ToolCall",
    "TrajectoryRow",
    "Turn",
    "sequences",
]
__version__ = "0.1.0"
