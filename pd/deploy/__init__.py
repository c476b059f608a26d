"""Deployment: Ray placement and startup of workers and router, and the launch command."""
