"""paraflex.serving: the serving frontend between the HTTP gateway and the engines (admission, dispatch, end/abort/free, KV-stall watch, recompute) and its in-process and Ray engine backends."""
