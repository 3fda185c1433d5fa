"""Job runners: the tier that drains durable batch jobs through the gateway at batch priority."""
