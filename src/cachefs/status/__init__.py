"""What a node holds, read-only: the summary `cachefs status` prints, the Prometheus collector over it, and the
node's one scrape endpoint."""
