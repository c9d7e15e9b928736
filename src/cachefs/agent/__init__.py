"""The node agent (``cachefs agent``): the peer server, the membership watch and the node's other long-running
duties (:mod:`.node_agent`)."""

from cachefs.agent.node_agent import AgentContext, run_agent

__all__ = ["AgentContext", "run_agent"]
