"""Engine replicas on Ray behind one websocket front end (install the `cluster` extra)."""
