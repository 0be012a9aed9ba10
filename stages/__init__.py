"""The stage programs: sft, reward, ppo and e2e, one readable file each."""
