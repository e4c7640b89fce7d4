"""The default of `[hosts.X] protected_paths` (api/config.py): its own module, as the
configuration module is at the layout's size limit."""

# What the files API never writes, whatever the roots (`[hosts.X] protected_paths`): paths
# relative to the account's home that sshd or a login shell reads and runs or trusts, each with
# everything under it. `.ssh/` holds rc (run by sshd before every command when PermitUserRC is
# on, OpenSSH's default), authorized_keys and environment; the rest are the start-up and logout
# files of bash, sh, zsh, csh/tcsh, ksh and fish, what Debian's and Fedora's .bashrc source
# (.bash_aliases, .bashrc.d/), PAM's and the user manager's environment, the files that
# grant logins or forward mail to a program (.rhosts, .shosts, .k5login, .k5users, .forward),
# and Python's user site directories (.local/lib/pythonX.Y/site-packages, every version: a
# usercustomize.py or a .pth file there runs in every python3 the account starts).
PROTECTED_PATHS = (
    ".ssh",
    ".bashrc",
    ".bash_profile",
    ".bash_login",
    ".bash_logout",
    ".bash_aliases",
    ".bashrc.d",
    ".profile",
    ".zshrc",
    ".zshenv",
    ".zprofile",
    ".zlogin",
    ".zlogout",
    ".cshrc",
    ".tcshrc",
    ".login",
    ".logout",
    ".kshrc",
    ".mkshrc",
    ".pam_environment",
    ".config/fish",
    ".config/environment.d",
    ".config/systemd",
    ".forward",
    ".rhosts",
    ".shosts",
    ".k5login",
    ".k5users",
    ".local/lib",
)
