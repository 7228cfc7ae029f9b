"""Tracing: nn.Module + example inputs -> Program (torch.export), and the checks that the trace is faithful."""
