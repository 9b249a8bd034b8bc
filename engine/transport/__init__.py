"""paraflex.engine.transport: how work moves between engines (the hop between pipeline stages): one interface, an in-process and a Ray + torch.distributed implementation."""
