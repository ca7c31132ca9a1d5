"""The KV handoff: the block manager and its prefix cache, the paged pool and its export/import, the transfer
backends behind one interface, fault injection, and the peers and transfers both node roles track."""
