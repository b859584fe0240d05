from v41_jax import xla_env

xla_env.apply()
