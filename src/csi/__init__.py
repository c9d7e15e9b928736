"""CSI driver for cachefs datasets (see issue: CSI driver and deploy/)."""
