"""Process groups under any launcher, collectives, peer watch and host settings (`world`); facts about the
accelerator that choose defaults (`device`)."""
