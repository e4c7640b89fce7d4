// The rig's OpenID provider: panva's oidc-provider (OpenID Certified) with the device flow,
// refresh tokens, client credentials and JWT access tokens for the API (aud, scope,
// preferred_username). Never for production: any login/password passes its dev login page,
// its signing keys are the library's development keys, and it keeps everything in memory.
// Started by sshpool/devhost/oidc.py with one argument: a JSON file of its settings.
import { readFileSync } from 'node:fs';
import Provider from 'oidc-provider';

const conf = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const SCOPES = conf.scopes.join(' ');

const provider = new Provider(conf.issuer, {
  clients: conf.clients,
  scopes: ['openid', 'offline_access', ...conf.scopes],
  ttl: {
    AccessToken: conf.access_ttl,
    ClientCredentials: conf.access_ttl,
    DeviceCode: conf.device_code_ttl,
    RefreshToken: conf.refresh_ttl,
    Grant: conf.refresh_ttl,
    Session: conf.refresh_ttl,
    Interaction: 600,
  },
  features: {
    devInteractions: { enabled: true },
    deviceFlow: { enabled: true },
    clientCredentials: { enabled: true },
    revocation: { enabled: true },
    resourceIndicators: {
      enabled: true,
      defaultResource: async () => conf.resource,
      useGrantedResource: async () => true,
      getResourceServerInfo: async (ctx, resource) => {
        if (resource !== conf.resource) throw new Provider.errors.InvalidTarget();
        return {
          scope: SCOPES,
          audience: conf.audience,
          accessTokenTTL: conf.access_ttl,
          accessTokenFormat: 'jwt',
          jwt: { sign: { alg: 'RS256' } },
        };
      },
    },
  },
  // The researcher approves by signing in: the rig asks no separate consent.
  loadExistingGrant: async (ctx) => {
    const grantId = ctx.oidc.result?.consent?.grantId
      || ctx.oidc.session.grantIdFor(ctx.oidc.client.clientId);
    if (grantId) return ctx.oidc.provider.Grant.find(grantId);
    const grant = new ctx.oidc.provider.Grant({
      clientId: ctx.oidc.client.clientId,
      accountId: ctx.oidc.session.accountId,
    });
    grant.addOIDCScope('openid offline_access');
    grant.addResourceScope(conf.resource, SCOPES);
    await grant.save();
    return grant;
  },
  issueRefreshToken: async (ctx, client) => client.grantTypeAllowed('refresh_token'),
  // Rotation would make two processes sharing one cached login race each other.
  rotateRefreshToken: false,
  extraTokenClaims: async (ctx, token) => {
    const account = token.accountId ?? conf.client_accounts[token.clientId];
    return account ? { preferred_username: account } : undefined;
  },
});
provider.proxy = false;
const server = provider.listen(conf.port, conf.host, () => {
  process.stdout.write(`oidc-provider listening on ${conf.issuer}\n`);
});
const stop = () => server.close(() => process.exit(0));
process.on('SIGTERM', stop);
process.on('SIGINT', stop);
