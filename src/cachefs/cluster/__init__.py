"""The cluster cache below the read path: the group protocol both sides share (:mod:`.keys`), a cache group's members
(:mod:`.membership`), which of them own a key (:mod:`.placement`), a process's link to its node's group
(:mod:`.link`), the peer client (:mod:`.peer_client`), authentication (:mod:`.auth`) and TLS between members. The
agent's peer server is :mod:`cachefs.agent.peer_server`; docs/CLUSTER.md describes the design."""
