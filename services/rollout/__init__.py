"""Rollout: runtime version labels and traffic weights (services.common.model_routing)."""
