"""On-disk and on-origin formats: pack files of small objects, and a dataset's packed mirror."""
