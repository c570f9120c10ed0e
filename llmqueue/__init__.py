"""llmqueue: tenants, tiers and quotas, admission, and submission of prompts to GPU pools."""
