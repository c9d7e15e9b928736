"""What every layer of cachefs stands on: the error tree, configuration, value types, the event-loop bridge,
checksums, metric names and crash-safe file writes."""
