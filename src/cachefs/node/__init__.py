"""The read path's shared services on a node: memory and the origin funnel, single-flight, disk jobs, room on the
disk, open object files, access statistics, eviction and its policies, packs assembled from a mirror."""
