"""The target service: verifies draft tokens on the target model and holds versioned session state."""
