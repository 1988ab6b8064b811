"""Data-plane worker processes and the control process's side of them (DESIGN §9)."""
