"""nn.Modules wiring the ops; parameter names follow the released checkpoint."""
