"""kvpool GPU client (torch). Empty until the GPU-client issue lands."""
