"""What every process of a deployment shares: deploy config schema, roles, endpoints, router <-> worker messages."""
