"""Getting an admitted request onto its queue: model routing, lanes, the row, the task message."""
