"""The cluster cache: a cache group's members (:mod:`.membership`), which of them own a key
(:mod:`.placement`), the peer protocol's server and client (:mod:`.peer_server`, :mod:`.peer_client`) and its
authentication (:mod:`.auth`). docs/CLUSTER.md describes the design."""
